"""The tasks: the task contract (environment.py), countdown and the example tasks, and the one
evaluation every stage uses. A task is a setting: task = "tasks.countdown"."""
