"""Is select_rows' spread between runs the SM clock? Times select_rows alone (256 rows
x 128K, K 2048) over rounds, half after a heavy matmul burst, while nvidia-smi samples
the SM clock; prints each round's busy us beside the clocks sampled during it."""
import subprocess, sys, time, os
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from bench.common import device_busy_by_kernel
from jsparse.ops.topk import triton as select
from jsparse.ops.indexer.methods import candidate_capacity

out = os.environ.get("OUT", "/tmp")
log = open(f"{out}/clocks.csv", "w")
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                        "--format=csv,noheader", "-lms", "50"], stdout=log)
print(subprocess.run(["nvidia-smi", "-q", "-d", "CLOCK,PERFORMANCE"], capture_output=True, text=True).stdout[-2500:])
T, S, K = 256, 131072, 2048
cap = candidate_capacity(K, S)
scores = jax.random.normal(jax.random.key(0), (T, S), jnp.float32)
start = jnp.zeros((T,), jnp.int32); end = jnp.full((T,), S, jnp.int32)
ids, count, slow = jax.jit(lambda s: select.compact_rows(s, start, end, K, cap))(scores)
print("cap", cap, "count max", int(count.max()), "slow paths", int((slow != 0).sum()))
sel = jax.jit(lambda s, i, c: select.select_rows(s, i, c, K, scores_out=True))
a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
mm = jax.jit(lambda x: (x @ x).sum())
for r in range(12):
    if r % 2:
        t_end = time.time() + 0.5
        while time.time() < t_end:
            mm(a).block_until_ready()
    t0 = time.time()
    busy = device_busy_by_kernel(sel, [(scores, ids, count)], calls=30)
    t1 = time.time()
    us = {k: round(v * 1e6, 1) for k, v in busy.items()}
    print(f"round {r} {'after matmul' if r % 2 else 'idle before'} wall {t0:.3f}-{t1:.3f}: {us}", flush=True)
    time.sleep(0.3)
smi.terminate(); log.close()
print(open(f"{out}/clocks.csv").read()[-6000:])
