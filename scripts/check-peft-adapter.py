"""Checks a directory written by `oomfix train --lora R --save DIR` as PEFT
reads it: `peft.PeftModel.from_pretrained(base, DIR)` loads it on the base
model (AutoModelForCausalLM, float32) with every adapter weight taken from
the file, and with `--logits FILE` (a safetensors file of `input_ids` [b, s]
and the f32 `logits` [b, s, V] oomfix computed with those adapters) its
logits on those ids equal them within 1e-4 of the largest logit.

Usage: python scripts/check-peft-adapter.py BASE_DIR ADAPTER_DIR [--logits FILE]
       (exit 0: every check passed)
"""

import json
import os
import sys

import peft
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main(argv):
    if len(argv) not in (2, 4) or (len(argv) == 4 and argv[2] != "--logits"):
        print(__doc__, file=sys.stderr)
        return 2
    base_dir, adapter_dir = argv[0], argv[1]
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["peft_type"] == "LORA", config
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                attn_implementation="eager")
    model = peft.PeftModel.from_pretrained(base, adapter_dir)
    model.eval()
    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    state = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    assert set(state) == set(saved), (sorted(set(state) ^ set(saved)))[:5]
    for name, t in saved.items():
        assert torch.equal(state[name].float(), t.float()), name
    print(f"peft {peft.__version__}: loaded {len(saved)} adapter tensors, r {config['r']}, "
          f"alpha {config['lora_alpha']}, targets {sorted(config['target_modules'])}")
    if len(argv) == 4:
        ref = load_file(argv[3])
        with torch.no_grad():
            logits = model(input_ids=ref["input_ids"].long()).logits.float()
        want = ref["logits"]
        err = (logits - want).abs().max().item() / want.abs().max().item()
        print(f"logits: PEFT vs oomfix, largest difference {err:.2e} of the largest logit")
        if err > 1e-4:
            print("FAILED: the logits differ", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
