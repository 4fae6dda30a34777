"""Errors that stop a run and name the part that failed."""


class ComponentDied(RuntimeError):
    """A part of the run (engine, train worker, retrieval server, reward workers) is gone."""
