"""Speculation: the drafting algorithms, draft trees, and how many tokens each round drafts."""
