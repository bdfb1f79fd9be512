"""People's scheduled tasks (SPEC §5.3): what a task is, its schedule, its table. The part
that runs them on a clock is gateway/jobs/tasks.py."""
