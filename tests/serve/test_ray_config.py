"""``pipemap serve --ray --config-out FILE``: a Ray Serve config file Ray's own schema accepts, its builder making
the same application the command line deploys."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the Ray Serve tests need ray: pip install -e '.[ray]'")
yaml = pytest.importorskip("yaml")
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from pipemap.cli import main  # noqa: E402
from pipemap.serve import Options  # noqa: E402
from pipemap.serve.access import Access  # noqa: E402
from pipemap.serve.ray_config import BUILDER, build, options_args, options_of  # noqa: E402


def test_the_config_file_passes_ray_s_schema_and_builds_the_deployment(tiny_folders, tmp_path, capsys):
    out = tmp_path / "serve.yaml"
    assert main(["serve", tiny_folders["sd"], "--ray", "--hardware", "cpu=4GiB", "--replicas", "2",
                 "--replicas-per-node", "1", "--max-queue", "3", "--api-key", "secret", "--config-out",
                 str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    text = out.read_text()
    assert "secret" not in text  # the key comes from PIPEMAP_API_KEY where the builder runs
    schema = ServeDeploySchema.model_validate(yaml.safe_load(text))
    assert schema.proxy_location == "HeadOnly" and schema.http_options.port == 8000
    (app,) = schema.applications
    assert app.import_path == BUILDER and app.route_prefix == "/"
    (deployment,) = app.deployments
    assert (deployment.num_replicas, deployment.max_replicas_per_node) == (2, 1)
    assert deployment.backpressure_config.status_code == 429
    built = build(app.args)._bound_deployment  # what `serve deploy` runs: the same deployment
    assert built.num_replicas == 2 and built._deployment_config.max_ongoing_requests == deployment.max_ongoing_requests


def test_options_go_through_the_file_and_back_but_the_key(monkeypatch):
    options = Options("sd", hardware="2x24GiB", strategy={"vae": "cpu"}, names=("a", "b"),
                      access=Access("secret", False, 2048), max_batch=4)
    monkeypatch.setenv("PIPEMAP_API_KEY", "from-env")
    back = options_of(yaml.safe_load(yaml.safe_dump(options_args(options))))
    assert back == Options("sd", hardware="2x24GiB", strategy={"vae": "cpu"}, names=("a", "b"),
                           access=Access("from-env", False, 2048), max_batch=4)
