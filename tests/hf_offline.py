"""An export loaded by transformers in a fresh process with the hub offline, as a user elsewhere would load it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_PROBE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out, text, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
ids = tokenizer(text, return_tensors="pt").input_ids
with torch.no_grad():
    logits = model(ids).logits
greedy = model.generate(ids, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)[0, ids.shape[1]:]
print(json.dumps({"type": model.config.model_type, "ids": ids[0].tolist(), "logits": logits[0].tolist(),
                  "greedy": greedy.tolist()}))
"""


def load_offline(out: Path, text: str, new_tokens: int) -> dict:
    """The export's model type, the ids of `text`, the logits at every position and `new_tokens` greedy tokens."""
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, str(out), text, str(new_tokens)],
        capture_output=True,
        text=True,
        env=offline,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
