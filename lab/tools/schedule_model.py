"""How evenly the persistent CTAs of the causal Mosaic forward share their work.

  PYTHONPATH=. python lab/tools/schedule_model.py            # the bench shapes, head_dim 64 and 128
  PYTHONPATH=. python lab/tools/schedule_model.py --ctas 114  # an H100 PCIe's SMs

For each bench shape (16384 tokens, hidden 2048) the work of a CTA is the
ring steps of its tiles plus one step a tile (`TILE_OVERHEAD_STEPS`);
the kernel's time follows its busiest CTA. Printed: that CTA's work over the
mean, for the heavy-light pairs dealt round-robin (`PersistentSchedule`
without `work`) and for the balanced table (`MosaicForwardConfig.balanced`). A model
only: lab/NOTES.md (session 15) has what the kernels measured. CPU only.
"""

from __future__ import annotations

import argparse

import importlib

import jax.numpy as jnp
import numpy as np

from jax_flash2 import defaults


def _schedule_module():
  """The Mosaic module that holds PersistentSchedule and q_tile_work (a model
  of kernel internals, so it follows them: mosaic/common.py, or forward.py
  before the kernels shared a module)."""
  for name in ("jax_flash2.mosaic.common", "jax_flash2.mosaic.forward"):
    try:
      module = importlib.import_module(name)
    except ImportError:
      continue
    if hasattr(module, "PersistentSchedule"):
      return module
  raise SystemExit("schedule_model: no PersistentSchedule in jax_flash2.mosaic")


mosaic = _schedule_module()


def _overhead() -> int:
  """A tile's cost beyond its ring steps, as the balanced table counts it."""
  return getattr(mosaic, "TILE_OVERHEAD_STEPS", None) or getattr(mosaic, "_TILE_OVERHEAD_STEPS")


def tile_work(seq: int, config) -> tuple[int, ...]:
  """The ring steps of each causal Q tile of a seq x seq problem tiled by
  `config` (a MosaicForwardConfig), block 0 the heaviest."""
  num_q_blocks = -(-seq // config.block_q)
  kwargs = dict(block_q=config.block_q, block_kv=config.block_kv, consumers=config.consumers)
  try:  # the kernels' static mask (jax_flash2.mask.Mask)
    from jax_flash2.mask import Mask

    return mosaic.q_tile_work(num_q_blocks, mask=Mask(seq, seq, causal=True), **kwargs)
  except (ImportError, TypeError):  # the form before the mask had a class
    return mosaic.q_tile_work(num_q_blocks, seq_q=seq, seq_k=seq, **kwargs)


def schedules(seq: int, head_dim: int, config, *, ctas: int = 132):
  """(paired, balanced): the causal persistent schedules of the bench shape
  (16384 tokens, hidden 2048) at `seq`, and the tiles' work."""
  batch, heads = max(16384 // seq, 1), 2048 // head_dim
  num_q_blocks = -(-seq // config.block_q)
  work = tile_work(seq, config)
  num_ctas = min(ctas, -(-num_q_blocks * heads * batch // 2))  # as PersistentSchedule.create, causal
  paired = mosaic.PersistentSchedule(num_q_blocks, heads, batch, num_ctas, paired=True)
  balanced = mosaic.PersistentSchedule(num_q_blocks, heads, batch, num_ctas, paired=True, work=work)
  return paired, balanced, work


def busiest_over_mean(schedule, work: tuple[int, ...]) -> float:
  """The busiest CTA's work over the mean, tiles costing work[block] plus the overhead."""
  table = jnp.asarray(schedule.table())
  loads = []
  for cta in range(schedule.num_ctas):
    count = int(schedule.tile_count(jnp.int32(cta), table))
    blocks = [int(schedule.tile(jnp.int32(cta), jnp.int32(i), table)[0]) for i in range(count)]
    loads.append(sum(work[b] + _overhead() for b in blocks))
  return max(loads) / float(np.mean(loads))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, nargs="*", default=[2048, 4096, 8192, 16384])
  parser.add_argument("--head-dim", type=int, nargs="*", default=[64, 128])
  parser.add_argument("--ctas", type=int, default=132, help="persistent CTAs: one per SM (132 on the H100 SXM/H200)")
  args = parser.parse_args()
  print(f"{'d':>4} {'seq':>6} {'consumers':>9} {'Q blocks':>8} {'paired':>7} {'balanced':>8}")
  for head_dim in args.head_dim:
    for seq in args.seq:
      config = defaults.mosaic_forward(head_dim, seq_q=seq, causal=True)
      paired, balanced, work = schedules(seq, head_dim, config, ctas=args.ctas)
      print(f"{head_dim:>4} {seq:>6} {config.consumers:>9} {len(work):>8}"
            f" {busiest_over_mean(paired, work):>7.3f} {busiest_over_mean(balanced, work):>8.3f}")

if __name__ == "__main__":
  main()
