"""``pipemap serve --ray --config-out serve.yaml``: the deployment as a Ray Serve config file, for ``serve deploy``.

The file names pipemap's app builder (``build``) with the serve options as its ``args``, and spells out the
deployment's settings (``deployments:``: replicas or autoscaling, limits, ``ray_actor_options``) where an operator
tunes them; it is checked against Ray's own schema (``ServeDeploySchema``) before it is written. The API key is
never written: the builder reads ``PIPEMAP_API_KEY`` where it runs (the application's ``runtime_env``, or the
cluster's environment).

>>> write_config(Options("path/to/sdxl", hardware="2x24GiB"), RaySettings(replicas=2), "0.0.0.0", 8000,
...              "serve.yaml")                                                              # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml
from ray.serve.schema import ServeDeploySchema

from .access import Access
from .deployment import RaySettings, application, deployment_options, http_options
from .service import Options, make_plan

BUILDER = "pipemap.serve.ray_config:build"
KEY_ENV = "PIPEMAP_API_KEY"


def options_args(options: Options) -> dict:
    """``options`` as plain YAML values, the API key left out."""
    args = {field.name: getattr(options, field.name) for field in dataclasses.fields(options)}
    args["names"] = list(options.names)
    args["access"] = {"local": options.access.local, "max_body": options.access.max_body}
    return args


def options_of(args: dict) -> Options:
    """The options ``options_args`` wrote (the API key from ``PIPEMAP_API_KEY``, where the builder runs)."""
    given = {name: value for name, value in args.items() if name not in ("names", "access")}
    access = Access(os.environ.get(KEY_ENV) or None, **args.get("access", {}))
    return Options(**given, names=tuple(args.get("names", ())), access=access)


def config(options: Options, settings: RaySettings, host: str, port: int) -> dict:
    """The Ray Serve config file's content, validated by Ray's ``ServeDeploySchema`` (a ``ValidationError``
    otherwise)."""
    plan = make_plan(options)
    deployment = deployment_options(options, settings, plan)
    app = {"name": "pipemap", "route_prefix": "/", "import_path": BUILDER,
           "args": {"options": options_args(options), "settings": dataclasses.asdict(settings)},
           "deployments": [deployment]}
    data = {"proxy_location": settings.proxy_location, "http_options": http_options(options, host, port),
            "applications": [app]}
    ServeDeploySchema.model_validate(data)
    return data


def write_config(options: Options, settings: RaySettings, host: str, port: int, path: str | Path) -> Path:
    """Write ``config`` to ``path`` as YAML; return it."""
    path = Path(path)
    text = yaml.safe_dump(config(options, settings, host, port), sort_keys=False)
    path.write_text("# pipemap serve --ray, for `serve deploy` (Ray Serve); the API key: PIPEMAP_API_KEY\n" + text,
                    encoding="utf-8")
    return path


def build(args: dict):
    """Ray Serve's app builder (the config's ``import_path``): the application for the options in ``args``; the
    plan is made where it runs and sizes each replica's request, and each replica plans for its node unless the
    hardware is pinned."""
    settings = RaySettings(**args.get("settings", {}))
    return application(options_of(args["options"]), settings)
