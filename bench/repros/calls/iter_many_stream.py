"""DEFECT (two): pipemap.iter_many as a request stream, as its docstring/README invite ("calls is read lazily ...
so it may be an endless iterator, e.g. a request queue").
1. Over iter(queue.get, None) an answer comes out only once 2 * workers + 1 requests are in (it islices 2 * workers
   ahead, then reads the next call before yielding the oldest answer): a client that waits for its answer before
   sending its next request waits forever; with many clients every answer lags 5 requests (workers=2).
2. A LoRA loaded while the stream runs is never followed (follow() runs once, when iter_many starts; the twins'
   calls do not follow): parallel -> silently wrong images (0.27 max abs diff); offload/stream on a GPU -> device
   error (fake CUDA: "Expected all tensors to be on the same device, cpu and cuda:0"). Needs peft."""
import queue
import threading

from _common import *

# 1: the blocking request queue
pipe, plan = placed_roomy("sd", "balanced", "cpu")
requests, answers = queue.Queue(), queue.Queue()
threading.Thread(target=lambda: [answers.put(o) for o in pipemap.iter_many(
    pipe, iter(requests.get, None), workers=2, plan=plan)], daemon=True).start()
requests.put(call_of("sd", pipe))
try:
    answers.get(timeout=30)
    row("1 request into iter_many(pipe, iter(q.get, None))", "sd balanced, cpu", "answered", "answered", "-", True)
except queue.Empty:
    row("1 request into iter_many(pipe, iter(q.get, None))", "sd balanced, cpu", "answered", "no answer in 30 s",
        "-", False)
sent = 0
while True:  # how many requests must be in before the next answer comes out? (adapted: the first check above took
    # the first answer, so the original loop waited for a second answer before sending a second request: it read 2)
    requests.put(call_of("sd", pipe))
    sent += 1
    try:
        answers.get(timeout=20)
        break
    except queue.Empty:
        pass
row("requests sent before the 1st answer came (workers=2)", "sd balanced, cpu", "1", str(sent),
    "each answer waits for the request 2 * workers + 1 after it", sent == 1)
requests.put(None)

# 2: a LoRA loaded between requests of a running stream
lora = save_lora("sd", seed=4)
ref = plain("sd")
want = [run(ref, "sd"), run(ref, "sd")]
ref.load_lora_weights(lora, adapter_name="s")
want += [run(ref, "sd"), run(ref, "sd")]
for strategy in ("parallel", "balanced_low_memory"):
    for mode in ("cpu", "fake"):
        with fake_cuda() if mode == "fake" else contextlib.nullcontext():
            pipe, plan = placed_roomy("sd", strategy, mode)
            finished = threading.Semaphore(0)
            post = pipe.image_processor.postprocess
            pipe.image_processor.postprocess = lambda *a, **k: (post(*a, **k), finished.release())[0]

            def calls():
                for i in range(4):
                    if i == 2:  # requests 0 and 1 are done: nothing in flight
                        finished.acquire(); finished.acquire()
                        pipe.load_lora_weights(lora, adapter_name="s")
                    yield call_of("sd", pipe)

            def stream():
                outs = pipemap.iter_many(pipe, calls(), workers=1, plan=plan if mode == "cpu" else None)
                return torch.cat([output(o).flatten() for o in outs])

            attempt("LoRA loaded mid-stream, requests 2-3 must have it", f"sd {strategy}, {mode}",
                    torch.cat([w.flatten() for w in want]), stream)
finish()
