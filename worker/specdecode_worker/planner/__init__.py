"""The planner: the dry-run memory plan, the hub models it reads, and other engines' pricing."""
