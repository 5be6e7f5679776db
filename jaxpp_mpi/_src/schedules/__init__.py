"""Pipeline schedules: tasks, the library, the checker, CSV schedules, the CLI."""
