"""Kept for one release: the policy endpoint lives in `rlf_train.rollout.endpoint`; import it from there."""
