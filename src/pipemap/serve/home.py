"""The server's home page: the plan picture, live figures, and a prompt box that calls the generation endpoint.

Plain HTML with the SVG inline and a few lines of script: no front-end build step, nothing fetched from elsewhere.
"""

from __future__ import annotations

from html import escape

from ..plan import Plan

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pipemap serve: {title}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 60em; color: #222; }}
#figures span {{ display: inline-block; min-width: 12em; margin-right: 1em; }}
#result img {{ max-width: 512px; border: 1px solid #aaa; margin-top: 1em; }}
.error {{ color: #a00; }}
</style></head>
<body>
<h1>pipemap serve</h1>
<p>{title}</p>
<section id="plan" aria-label="where each component lives">{svg}</section>
<section id="figures" aria-live="polite">
<span>queue depth: <b id="queue">-</b></span><span>seconds per image: <b id="seconds">-</b></span>
<span>bytes moved: <b id="moved">-</b></span><span>requests: <b id="requests">-</b></span>
</section>
<form id="generate">
<label for="prompt">Prompt</label> <input id="prompt" name="prompt" size="60" value="a photo of a cat">
<label for="steps">steps</label> <input id="steps" name="steps" type="number" min="1" value="{steps}" size="4">
<button id="go" type="submit">Generate</button>
</form>
<div id="result"></div>
<script>
const size = "{size}" || null;
function metric(text, name) {{
  let total = null;
  for (const line of text.split("\\n")) {{
    if (line.startsWith(name) && !line.startsWith("#")) {{
      const value = parseFloat(line.trim().split(/\\s+/).pop());
      if (!isNaN(value)) total = (total || 0) + value;
    }}
  }}
  return total;
}}
function bytes(v) {{  // as pipemap.format_bytes: the unit picked by size
  for (const [unit, size] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) {{
    if (Math.abs(v) >= size) return (v / size).toFixed(2) + " " + unit;
  }}
  return v.toFixed(0) + " B";
}}
async function refresh() {{
  try {{
    const text = await (await fetch("{metrics}")).text();
    const show = (id, name, digits, format) => {{
      const v = metric(text, name);
      document.getElementById(id).textContent = v === null ? "-" : (format ? format(v) : v.toFixed(digits));
    }};
    show("queue", "{queue_metric}", 0); show("requests", "{requests_metric}", 0);
    show("moved", "{moved_metric}", 0, bytes);
    const sum = metric(text, "{seconds_metric}_sum"), count = metric(text, "{seconds_metric}_count");
    document.getElementById("seconds").textContent = count ? (sum / count).toFixed(2) : "-";
  }} catch (e) {{ /* the figures wait for the next tick */ }}
}}
document.getElementById("generate").addEventListener("submit", async (event) => {{
  event.preventDefault();
  const result = document.getElementById("result");
  result.textContent = "generating...";
  const body = {{prompt: document.getElementById("prompt").value, n: 1, size: size, response_format: "b64_json",
                num_inference_steps: parseInt(document.getElementById("steps").value)}};
  const answer = await fetch("{generate}", {{method: "POST", headers: {{"Content-Type": "application/json"}},
                                           body: JSON.stringify(body)}});
  const data = await answer.json();
  if (!answer.ok) {{ result.innerHTML = ""; const p = document.createElement("p"); p.className = "error";
    p.textContent = JSON.stringify(data); result.appendChild(p); return; }}
  const img = document.createElement("img");
  img.id = "image"; img.alt = body.prompt; img.src = "data:image/png;base64," + data.data[0].b64_json;
  result.innerHTML = ""; result.appendChild(img); refresh();
}});
refresh(); setInterval(refresh, 2000);
</script>
</body></html>
"""


def home_page(plan: Plan, title: str, *, size: str = "", steps: int = 20, moved=None,
              generate: str = "/v1/images/generations", metrics: str = "/metrics",
              names: dict[str, str] | None = None) -> str:
    """The home page for a served pipeline: ``plan``'s picture inline, live figures read from ``metrics``
    (Prometheus text; ``names`` maps queue/requests/moved/seconds to the metric names) and a prompt box."""
    names = {"queue": "pipemap_queue_depth", "requests": "pipemap_requests_total",
             "moved": "pipemap_bytes_moved_total", "seconds": "pipemap_image_seconds", **(names or {})}
    return PAGE.format(title=escape(title), svg=plan.picture(moved).svg(), size=escape(size), steps=int(steps),
                       generate=generate, metrics=metrics, queue_metric=names["queue"],
                       requests_metric=names["requests"], moved_metric=names["moved"],
                       seconds_metric=names["seconds"])
