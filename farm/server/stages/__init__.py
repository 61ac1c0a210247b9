"""Stages on the worker (docs/architecture.md §15): the catalog of stage outputs, the phase of
a job that runs its recipe, and one child-side module per stage kind.

- `catalog`: the `stage_outputs` rows, single flight (claim, wait, take over, finish, fail);
- `phase`: `run_recipe`, what the job runner calls before its compile;
- `child`: the sandbox's child entry for the ``stage`` op, dispatching to a kind's module;
- `convert`: the ``convert`` kind (OpenVINO frontends, torch, optimum-intel).

A new stage kind: register its keys in `farm.core.stages` (`register(StageKind(...))`), add
its child module here with ``prepare(args)`` and ``run(request) -> StageOutcome``, and name it
in `child.MODULES`.
"""
