"""``pipemap serve --ray`` past one machine: a Ray cluster of a head and three worker nodes simulated on this machine
(``ray.cluster_utils.Cluster``, every node on 127.0.0.1), each node of its own shape.

The head node has no CPU for replicas and runs Ray Serve's one HTTP proxy; each worker node has one CPU, and the
third too little RAM for a replica's plan, so the two replicas land one on each of the others; one node states its
hardware (``PIPEMAP_NODE_HARDWARE``: two small GPUs), the other's is found there, and each replica plans for its
own. Every Ray process listens on loopback only.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import socket
import time

import numpy as np
import pytest
import torch
from PIL import Image

ray = pytest.importorskip("ray", reason="the Ray Serve tests need ray: pip install -e '.[ray]'")
httpx = pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
psutil = pytest.importorskip("psutil")
yaml = pytest.importorskip("yaml")
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.serve.schema import ServeDeploySchema  # noqa: E402
from ray.util.state import list_actors  # noqa: E402

from pipemap.serve import Options, ray_proxy  # noqa: E402
from pipemap.serve.deployment import LOOPBACK_ENV, NODE_HARDWARE, RaySettings, deploy  # noqa: E402
from pipemap.serve.ray_config import write_config  # noqa: E402

pytestmark = pytest.mark.slow
GENERATIONS = "/v1/images/generations"
BODY = {"prompt": "a tiny cat", "size": "32x32", "num_inference_steps": 2, "seed": 5}
SMALL = 80 * 2**20  # each node's object store: the images are kilobytes
TOO_LITTLE = 2**20  # RAM: the tiny SD pipeline's weights alone are 5.75 MiB


@pytest.fixture(scope="module")
def cluster():
    """A head node (no CPU for replicas: Serve's controller and proxy need none) and three worker nodes of one CPU
    each, the first stating two 5 MiB GPUs as its hardware, the third with too little RAM for any replica; shut
    down however the tests end."""
    patch = pytest.MonkeyPatch()
    patch.setenv(LOOPBACK_ENV, "0")  # every process Ray starts takes 127.0.0.1 as its address
    # and this one, which read the variable when it imported ray: else it waits for ever on the head's GCS
    patch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
    patch.setenv(ray_proxy.ENV, ray_proxy.CALLBACK)  # Ray's proxy answers its own errors as the app does
    # the head's dashboard answers Ray's state API (which actor runs on which node)
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1",
                                                        "include_dashboard": True, "dashboard_port": _free_port(),
                                                        "object_store_memory": SMALL})
    try:
        stated = made.add_node(num_cpus=1, num_gpus=2, node_ip_address="127.0.0.1", object_store_memory=SMALL,
                               env_vars={NODE_HARDWARE: "2x5MiB,cpu=1GiB"})
        found = made.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=SMALL)
        # a node with a CPU free but less RAM (Ray's ``memory``) than a replica's plan keeps: it gets no replica
        small = made.add_node(num_cpus=1, memory=TOO_LITTLE, node_ip_address="127.0.0.1", object_store_memory=SMALL)
        ray.init(address=made.address, log_to_driver=False)
        patch.setenv("RAY_ADDRESS", made.address)
        yield {"head": made.head_node.node_id, "stated": stated.node_id, "found": found.node_id,
               "small": small.node_id, "cluster": made, "nodes": {stated.node_id: stated, found.node_id: found}}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            made.shutdown()
            patch.undo()


@pytest.fixture(scope="module")
def url(cluster, tiny_folders):
    """``pipemap serve --ray --replicas 2 --replicas-per-node 1`` on the cluster, no hardware pinned: each replica
    plans for its node. One request waiting and one running per replica at most."""
    options = Options(tiny_folders["sd"], headroom=0.0, max_queue=1, workers=1, timeout=60.0, max_steps=1000)
    return deploy(options, RaySettings(replicas=2, per_node=1), "127.0.0.1", _free_port())


def test_two_replicas_land_on_two_nodes_each_planned_for_its_own_and_answer_as_a_plain_run(cluster, url,
                                                                                          tiny_folders):
    alive = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
    replicas = [a for a in alive if (a.name or "").startswith("SERVE_REPLICA::pipemap")]
    # not on the node whose RAM is too small for the plan (each replica asks for its plan's, as Ray's ``memory``)
    assert sorted(a.node_id for a in replicas) == sorted([cluster["stated"], cluster["found"]])
    assert [a.node_id for a in alive if a.class_name == "ProxyActor"] == [cluster["head"]]  # one proxy, the head's

    want = (_plain(tiny_folders["sd"]) * 255).round()
    with httpx.Client(base_url=url, timeout=120) as client:
        answers = _until_both(client, lambda: client.post(GENERATIONS, json=BODY), cluster)
        for node, response in answers.items():
            assert np.abs(_image(response).astype(int) - want).max() <= 1, node
        where = {node: r.json() for node, r in _until_both(client, lambda: client.get("/v1/replica"),
                                                           cluster).items()}
        metrics = client.get("/metrics").text
    assert where[cluster["stated"]]["hardware_from"] == "node"
    assert where[cluster["stated"]]["hardware"] == "2x5MiB,cpu=1GiB"
    assert where[cluster["found"]]["hardware_from"] == "detected"
    assert set(where[cluster["found"]]["device_map"].values()) == {"cpu"}  # this machine has no GPU
    assert any(d.startswith("cuda:") for d in where[cluster["stated"]]["device_map"].values())
    assert "pipemap_replica_info{" in metrics and "node_id=" in metrics and 'strategy="' in metrics


def test_past_the_queue_the_app_answers_429_json_with_retry_after_and_one_request_id(url):
    # two replicas, each running one request and holding one: six slow requests at once leave some refused
    slow = {**BODY, "num_inference_steps": 900, "timeout": 6}
    with httpx.Client(base_url=url, timeout=120) as client:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            sent = [pool.submit(client.post, GENERATIONS, json=slow, headers={"X-Request-Id": f"r{i}"})
                    for i in range(6)]
            answers = [f.result() for f in sent]
    refused = [r for r in answers if r.status_code == 429]
    assert refused, [r.status_code for r in answers]
    assert {r.status_code for r in answers} <= {200, 429, 504}, [r.text[:200] for r in answers]  # no plain 503
    for response in refused:
        assert response.json()["error"]["code"] == "queue_full"
        assert int(response.headers["retry-after"]) >= 1
    for i, response in enumerate(answers):
        assert response.headers.get_list("x-request-id") == [f"r{i}"]


def test_requests_of_one_shape_go_to_the_replica_that_measured_it_while_it_has_a_worker_free(url, cluster):
    shaped = {**BODY, "size": "64x64"}  # a shape neither replica has answered yet
    with httpx.Client(base_url=url, timeout=120) as client:
        first = client.post(GENERATIONS, json=shaped)
        assert first.status_code == 200, first.text
        time.sleep(2)  # its replica's shapes reach the proxy's router (Ray pushes them every 0.1 s)
        # one after another, each finds the replica that measured the shape free (one worker each): Ray's own
        # router picks either replica, six in a row on the first's node 1 time in 64. Ray counts a request done
        # when its replica's call returns, a moment after the client has the answer: the pause waits for that
        nodes = []
        for i in range(6):
            time.sleep(0.5)
            nodes.append(client.post(GENERATIONS, json={**shaped, "seed": i}).headers["x-pipemap-node"])
        assert set(nodes) == {first.headers["x-pipemap-node"]}, nodes
        # two at once: the second finds the first's replica busy, and goes to the other replica rather than wait
        # there. The second leaves half a second after the first (Ray's router reads a replica's load from a cache
        # it refreshes: two requests in the same instant may both find it free); up to three pairs on a busy host
        seen: set[str] = set()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for pair in range(3):
                long = {**shaped, "seed": pair, "num_inference_steps": 60}
                first_of_pair = pool.submit(client.post, GENERATIONS, json=long)
                time.sleep(0.5)
                second_of_pair = pool.submit(client.post, GENERATIONS, json={**long, "seed": 10 + pair})
                seen = {r.result().headers["x-pipemap-node"] for r in (first_of_pair, second_of_pair)}
                if len(seen) == 2:
                    break
    assert seen == {cluster["stated"], cluster["found"]}


def test_every_socket_of_the_cluster_listens_on_loopback(url):
    listening = _listening(psutil.Process())
    assert listening and all(_loopback(address) for address, _ in listening), listening


def _listening(parent) -> list[tuple[str, str]]:
    """``(address, process name)`` of each socket listening in ``parent``'s process tree (Ray's processes)."""
    pids = {p.pid: p for p in [parent, *parent.children(recursive=True)]}
    found = []
    for conn in psutil.net_connections("inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            found.append((conn.laddr.ip, pids[conn.pid].name()))
    return found


def _loopback(address: str) -> bool:
    return address.removeprefix("::ffff:") in ("127.0.0.1", "::1")


def _until_both(client, ask, cluster, tries: int = 20) -> dict:
    """The first answer from each worker node's replica (``X-Pipemap-Node``), asking two at a time (one of a shape
    goes to the replica that measured it while it has a worker free: ``ray_router``) until both have answered."""
    answers: dict = {}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for _ in range(tries):
            for response in pool.map(lambda _: ask(), range(2)):
                assert response.status_code in (200, 429), response.text  # a replica's queue of one, full: again
                if response.status_code == 200:
                    answers.setdefault(response.headers["x-pipemap-node"], response)
            if len(answers) == 2:
                break
    assert set(answers) == {cluster["stated"], cluster["found"]}
    return answers


def _plain(folder: str) -> np.ndarray:
    from diffusers import DiffusionPipeline

    plain = DiffusionPipeline.from_pretrained(folder)
    plain.set_progress_bar_config(disable=True)
    return plain("a tiny cat", width=32, height=32, num_inference_steps=2, output_type="np",
                 generator=torch.Generator("cpu").manual_seed(5)).images[0]


def _image(response) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait(predicate, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "gave up waiting"
        time.sleep(0.2)


def test_the_written_config_file_deploys_on_the_cluster_as_serve_deploy_does(url, tiny_folders, tmp_path):
    out = tmp_path / "serve.yaml"
    port = int(url.rsplit(":", 1)[1])  # Serve's proxy already listens there: the file names the same
    write_config(Options(tiny_folders["sd"], max_queue=1, workers=1), RaySettings(replicas=1), "127.0.0.1", port,
                 out)
    serve.delete("pipemap")
    # what `serve deploy serve.yaml` asks of the controller, through the head's dashboard
    serve.context._get_global_client().deploy_apps(ServeDeploySchema.model_validate(yaml.safe_load(out.read_text())),
                                                   _blocking=True)
    with httpx.Client(base_url=url, timeout=120) as client:
        response = client.post(GENERATIONS, json=BODY)
        assert response.status_code == 200, response.text
        assert client.get("/v1/replica").json()["hardware_from"] in ("node", "detected")


def test_a_node_lost_under_load_leaves_no_request_unanswered_and_its_replica_comes_back_elsewhere(cluster, url):
    # after the config file's deployment: one replica, on one of the two worker nodes; that node is lost
    with httpx.Client(base_url=url, timeout=120) as client:
        lost = client.get("/v1/replica").json()["node_id"]
        answers: list = []
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            stream = [pool.submit(_ask, client, answers, 8) for _ in range(2)]
            _wait(lambda: len(answers) >= 4, 60)
            cluster["cluster"].remove_node(cluster["nodes"][lost])
            lost_at = time.monotonic()
            _wait(lambda: _answered_from_another(answers, lost), 90)
            back_in = time.monotonic() - lost_at
            for future in stream:
                future.result()
    statuses = [status for status, _, _, _ in answers]
    assert set(statuses) <= {200, 429, 503}, answers  # never Ray's plain 500, never a hang (a transport error)
    assert all(retry is not None for status, retry, _, _ in answers if status != 200)
    assert back_in < 60, back_in


def _ask(client, answers: list, seconds_after_back: float) -> None:
    """POST the small request over and over, noting (status, Retry-After, node, time) of each, until answers have
    come from a node other than the first's for ``seconds_after_back`` seconds."""
    while True:
        try:
            response = client.post(GENERATIONS, json={**BODY, "timeout": 30})
        except httpx.TransportError as error:  # a hang past the client's timeout: no answer
            answers.append((type(error).__name__, None, None, time.monotonic()))
            return
        answers.append((response.status_code, response.headers.get("retry-after"),
                        response.headers.get("x-pipemap-node"), time.monotonic()))
        nodes = [node for _, _, node, _ in answers if node]
        moved = [t for _, _, node, t in answers if node and node != nodes[0]]
        if moved and time.monotonic() - moved[0] > seconds_after_back:
            return


def _answered_from_another(answers: list, lost: str) -> bool:
    return any(status == 200 and node not in (None, lost) for status, _, node, _ in answers)
