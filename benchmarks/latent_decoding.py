"""MLA decoding with the up-projections absorbed against attending over keys and values expanded from the
cached latents, on the attention shape of the Moonlight-16B-A3B preset (16 heads, latent 512, heads of 128 +
64 rotary, values 128, no query compression).

    python benchmarks/latent_decoding.py [--cached 1024 4096] [--batch 1] [--steps 20] [--threads 2]

One attention layer of the preset (`configs/models/moonlight-16b-a3b.yaml`), random weights, fp32, on the CPU.
For each cache length T, a cache of T tokens is filled by a prefill, then each form decodes `--steps` tokens,
one at a time, from a copy of that cache; the time is the median step. Before timing, the outputs of the two
forms are compared (relative difference of every step's output). The last line is one JSON object: for each
T, the median step of each form in ms and `speedup` (expanded over absorbed).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from ferry.model import KVCache
from ferry.model.latent_attention import LatentAttention
from ferry.model.presets import load_preset
from ferry.model.rope import RotaryEmbedding


def _decode_steps(layer, cache: KVCache, x_BSD: torch.Tensor, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """Seconds and output of each of `steps` one-token steps appended to `cache`."""
    times, outputs = [], []
    for step in range(steps):
        began = cache.begin(1)
        started = time.perf_counter()
        outputs.append(layer(x_BSD[:, step : step + 1], cache.layer(0, began)))
        times.append(time.perf_counter() - started)
        cache.commit(began)
    return times, outputs


def _copy(cache: KVCache, form: str) -> KVCache:
    """A copy of the filled cache that decodes in `form`."""
    copied = copy.deepcopy(cache)
    copied.latent_decoding = form
    return copied


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cached", type=int, nargs="+", default=[1024, 4096], help="cached tokens T")
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together")
    parser.add_argument("--steps", type=int, default=20, help="decoding steps timed per form")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    preset = load_preset("moonlight-16b-a3b")
    config = preset.model_copy(update={"n_layers": 1, "max_seq_len": max(args.cached) + args.steps})
    torch.manual_seed(0)
    rope = RotaryEmbedding(config.rope_dim, config.max_seq_len, config.rope_theta, config.rope_scaling)
    layer = LatentAttention(config, rope).eval()
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    results = {}
    for cached in args.cached:
        prompt_BSD = torch.randn(args.batch, cached, config.dim)
        x_BSD = torch.randn(args.batch, args.steps, config.dim)
        filled = KVCache(
            config,
            torch.zeros(args.batch, dtype=torch.long),
            cached + args.steps,
            torch.float32,
            torch.device("cpu"),
            latent_decoding="expanded",
        )
        step = filled.begin(cached)
        layer(prompt_BSD, filled.layer(0, step))
        filled.commit(step)
        timed = {}
        outputs = {}
        for form in ("expanded", "absorbed"):
            _decode_steps(layer, _copy(filled, form), x_BSD, 2)  # warm-up
            times, outputs[form] = _decode_steps(layer, _copy(filled, form), x_BSD, args.steps)
            timed[form] = statistics.median(times)
        difference = max(
            float((a - e).norm() / e.norm()) for a, e in zip(outputs["absorbed"], outputs["expanded"], strict=True)
        )
        speedup = timed["expanded"] / timed["absorbed"]
        print(
            f"T={cached:>5}: expanded {timed['expanded'] * 1e3:7.2f} ms/step  absorbed {timed['absorbed'] * 1e3:6.2f} "
            f"ms/step  speedup {speedup:5.2f}x  (largest relative difference of a step's output {difference:.1e})"
        )
        results[str(cached)] = {
            "expanded_ms": round(timed["expanded"] * 1e3, 3),
            "absorbed_ms": round(timed["absorbed"] * 1e3, 3),
            "speedup": round(speedup, 2),
            "relative_difference": difference,
        }
    print(
        json.dumps(
            {"shape": "moonlight-16b-a3b attention", "batch": args.batch, "threads": args.threads, "results": results}
        )
    )


if __name__ == "__main__":
    main()
