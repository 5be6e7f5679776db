"""Seeing a step: per-task timing, Chrome traces, Gantt charts."""
