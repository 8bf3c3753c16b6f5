"""Ready-made reward configs (plain dicts, so they can be copied into YAML and edited)."""

from __future__ import annotations

import copy
from typing import Any


def _format_terms(f: float) -> dict[str, Any]:
    """RLFactory-style format shaping in [-2f-f/2, 2f]: answer tags, share of valid calls, too many calls."""
    return {
        "type": "weighted",
        "name": "format_shaping",
        "terms": [
            {
                "verifier": {
                    "type": "format", "name": "answer_tags", "tags": ["answer"], "require_answer": False,
                    "forbid_invalid_turns": False, "pass_value": f, "fail_value": -f,
                },
            },
            {"verifier": {"type": "tool_call_format", "low": -f, "high": f, "no_calls_value": -f}},
            {"verifier": {"type": "call_count", "max_calls": 2, "penalty": 0.5 * f, "mode": "flat"}},
        ],
    }


def search_r1_em(format_score: float = 0.0) -> dict[str, Any]:
    """Search-R1's `compute_score_em`: 1 for an exact match, `format_score` for a wrong but present answer,
    0 with no answer."""
    if format_score == 0.0:
        return {"type": "exact_match"}
    return {
        "type": "max",
        "name": "search_r1_em",
        "verifiers": [
            {"type": "exact_match"},
            {"type": "format", "require_answer": True, "forbid_invalid_turns": False,
             "pass_value": format_score, "fail_value": 0.0},
        ],
    }


def rlfactory_search(format_score: float = 0.1) -> dict[str, Any]:
    """Modelled on RLFactory's search env reward: with F the format shaping term,
    correct -> 1 + F/2, wrong -> F, no answer -> -format_score + F/2."""
    fmt = _format_terms(format_score)
    return {
        "type": "gate",
        "name": "rlfactory_search",
        "gate": {"type": "format", "name": "has_answer", "require_answer": True, "forbid_invalid_turns": False},
        "inner": {
            "type": "gate",
            "name": "correct",
            "gate": {"type": "exact_match"},
            "inner": {"type": "weighted", "name": "correct_branch", "terms": [
                {"verifier": {"type": "constant", "name": "base", "value": 1.0}},
                {"verifier": copy.deepcopy(fmt), "weight": 0.5},
            ]},
            "otherwise": copy.deepcopy(fmt),
        },
        "otherwise": {"type": "weighted", "name": "no_answer_branch", "terms": [
            {"verifier": {"type": "constant", "name": "no_answer_base", "value": -format_score}},
            {"verifier": copy.deepcopy(fmt), "weight": 0.5},
        ]},
    }


PRESETS = {"search_r1_em": search_r1_em, "rlfactory_search": rlfactory_search}
