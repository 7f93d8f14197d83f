"""The dry-run wing: a pipeline's own call run on stand-in devices, to prove a plan and measure each device's peak.

=============  =====================================================================================================
file           what it holds
=============  =====================================================================================================
run.py         the entry (``simulate``): the pipeline made fake, the plan applied by ``dispatch.place``, the call run
report.py      what a dry run reports (``SimulationReport``, ``Failure``)
standin.py     stand-in weights (fake tensors on ``meta:N``) and the stricter device checks
trackers.py    live and peak bytes per device, weights apart from activations, phases, the running component
patches.py     what pipeline code does to its models made to work on stand-ins (``vae.to``, outputs, host copies)
known.py       values computed only from real inputs kept real beside the fakes (schedules, masks)
catalog.py     a catalog pipeline at full size, built from its published configs, nothing downloaded
queues.py      the copy queues on stand-ins, which tell the tracker what is weights
=============  =====================================================================================================

Imports go one way: this wing uses the values, the planner's outputs and the hooks (``dispatch``); nothing below it
imports it.
"""
