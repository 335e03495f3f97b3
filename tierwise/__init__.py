"""Tierwise's composition root: the `planner` command line (`tierwise.cli`), which joins the pure
planner (`planner`), the runtime (`runtime`) and the dashboard (`app`). Nothing below imports it."""
