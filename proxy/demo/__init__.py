"""A demo tool with a side effect, and a walkthrough that shows a replay and a 409."""
