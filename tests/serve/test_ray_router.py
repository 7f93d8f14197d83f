"""Routing a request to a replica that has measured its shape (``ray_router``): the shape a request names, and which
replicas come first for it. The router inside Ray is run by the cluster test (``test_deployment_cluster.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="the Ray Serve tests need ray: pip install -e '.[ray]'")
from pipemap.serve.ray_router import ranks, shape_key  # noqa: E402

CAT = {"prompt": "a cat", "size": "64x64", "seed": 1, "num_inference_steps": 30, "guidance_scale": 5.0}


def test_a_shape_is_what_sets_the_activations_not_the_seed_or_the_words():
    assert shape_key(CAT) == "size=64x64,steps=2,guided=True,prompt=0"
    assert shape_key({**CAT, "prompt": "a dog", "seed": 2, "num_inference_steps": 3, "guidance_scale": 7.5}) == \
        shape_key(CAT)  # steps repeat; any guidance above 1 doubles the batch alike
    for changed in ({"size": "128x64"}, {"n": 2}, {"num_inference_steps": 1}, {"guidance_scale": 1.0},
                    {"prompt": "a cat" * 60}, {"negative_prompt": "blur"}, {"model": "other"}):
        assert shape_key({**CAT, **changed}) != shape_key(CAT), changed
    assert shape_key(["a list"]) is None and shape_key("text") is None and shape_key({}) is None


def test_a_shaped_request_goes_first_to_replicas_that_measured_it_with_a_worker_free_then_to_any_free():
    ongoing = {"a": 0, "b": 1, "c": 0, "d": None}
    replicas = [SimpleNamespace(name=name, multiplexed_model_ids=shapes)
                for name, shapes in (("a", {"s"}), ("b", {"s"}), ("c", {"t"}), ("d", {"s", "t"}))]

    def names(shape: str, busy_at: int = 1) -> list[set]:
        return [{r.name for r in rank} for rank in ranks(replicas, shape, lambda r: ongoing[r.name], busy_at)]

    # b runs its one request; c never measured s; d's count is unknown, as none. Then c, free; then two of all
    assert names("s")[:2] == [{"a", "d"}, {"c"}] and len(names("s")[2]) == 2
    assert names("s", busy_at=2)[:2] == [{"a", "b", "d"}, {"c"}]
    assert names("u")[0] <= {"a", "c", "d"} and len(names("u")[0]) == 2  # nobody measured it: two free ones
    ongoing.update(a=1, c=1, d=1)
    assert len(names("s")) == 1 and len(names("s")[0]) == 2  # all busy: the less busy of two, as Ray's router
