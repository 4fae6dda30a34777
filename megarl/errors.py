"""Errors that stop a run and name the part or the input that failed."""


class ComponentDied(RuntimeError):
    """A part of the run (engine, train worker, retrieval server, reward workers) is gone."""


class RunInputError(ValueError):
    """An input of the run (model files, output directory) that cannot be used; the message
    names the path, what is wrong with it and what to do. Found before anything starts."""
