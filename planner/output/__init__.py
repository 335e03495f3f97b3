"""What the planner hands out: tables and charts for people, configs for other frameworks."""
