"""A plugin with no backend: a task and a rollout engine, from the ``polyrl.plugins`` entry-point group."""

from polyrl.plugins import hookimpl


def dummy_task(**params):
    from polyrl.core.tasks import get_task

    return get_task("copy", **params)  # the built-in copy task under another name


def dummy_engine(model, *, pad_token_id, **kwargs):
    from polyrl.core.rollout.hf import HFEngine

    engine = HFEngine(model, pad_token_id=pad_token_id, **kwargs)
    engine.name = "dummy_engine"
    return engine


@hookimpl
def polyrl_register_tasks(register):
    register("dummy_task", dummy_task)


@hookimpl
def polyrl_register_rollout_engines(register):
    register("dummy_engine", dummy_engine)
