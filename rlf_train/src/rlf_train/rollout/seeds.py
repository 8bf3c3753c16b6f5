"""Seeds, derived from the run's seed (pure Python, no torch): per row of a sampling call and per call of an
endpoint session (`mix_seed`), per update of the env rollouts (`seed_base`) and of the async worker's sampler
(`sampler_seed`)."""

from __future__ import annotations

_M64 = (1 << 64) - 1


def mix_seed(base: int, key: int) -> int:
    """A 63-bit seed from (base, key) (splitmix64's finaliser on Python ints): row k of a sampling call gets
    `mix_seed(base, k)`, call k of an endpoint session `mix_seed(session seed, k)`."""
    z = ((base & _M64) * 0x9E3779B97F4A7C15 + (key & _M64) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) >> 1


def seed_base(seed: int, update: int) -> int:
    """The env seed of row 0 of `update`'s batch (sync and async runs alike)."""
    return (seed * 1_000_003 + update * 10_007) % (2**31)


def sampler_seed(seed: int, update: int) -> int:
    """The async worker's sampler seed when `update`'s first group starts."""
    return seed_base(seed, update) + 7_919
