"""Print the README's performance table for bench results of record.

  PYTHONPATH=. python lab/tools/readme_table.py bench/results/FOLDER/*/results.json \
      [--impls flash2 flash2-triton cudnn tokamax] [--modes fwd bwd fwd+bwd]

Each cell: wall-clock TFLOP/s of each impl, then the first impl's speed against cuDNN.
"""
import argparse
import json

ap = argparse.ArgumentParser()
ap.add_argument("files", nargs="+")
ap.add_argument("--impls", nargs="+", default=["flash2", "flash2-triton", "cudnn", "tokamax"])
ap.add_argument("--modes", nargs="+", default=["fwd", "bwd", "fwd+bwd"])
args = ap.parse_args()
cells = [c for f in args.files for c in json.load(open(f))["cells"] if c.get("status") == "ok"]
seqs = sorted({c["seqlen"] for c in cells})
print("| mode | mask | " + " | ".join(f"{s // 1024}k" for s in seqs) + " |")
print("|---|---|" + "---|" * len(seqs))
for mode in args.modes:
  for causal in (False, True):
    row = []
    for s in seqs:
      by = {c["impl"]: c for c in cells if c["mode"] == mode and c["causal"] == causal and c["seqlen"] == s}
      if not by:
        row.append("")
        continue
      tf = " / ".join(f"{by[i]['tflops']:.0f}" if i in by else "-" for i in args.impls)
      lead, ref = by.get(args.impls[0]), by.get("cudnn")
      row.append(f"{tf} ({ref['ms'] / lead['ms']:.2f}x)" if lead and ref else tf)
    if any(row):
      print(f"| {mode} | {'causal' if causal else 'full'} | " + " | ".join(row) + " |")
