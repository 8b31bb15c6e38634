from rollwise.rollout.pipeline import Group, GroupQueue, read_log

__all__ = ["Group", "GroupQueue", "read_log"]
