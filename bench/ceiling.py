"""The insert-ceiling search of bench/bench.py (issue 16): what limits the highest rate the relay
sustains on this machine.

Three ramps over --ceiling-rates, each stopped at the first rate it cannot hold:
1. Postgres alone: examples/load_gen inserting single-row transactions into a database with no
   slot and no relay. Its highest achieved rate is what the machine can commit.
2. Logical decoding alone: the same load with pg_recvlogical streaming the slot to /dev/null.
   Its highest held rate is what the machine can commit while a walsender decodes every
   commit, the cost any consumer of the slot pays: the fair ceiling for the relay. It is held
   by the relay's latency rules, applied to the walsender's send lag (bench/send_lag.py).
3. The stream: the same load with the relay streaming it into Valkey (bench/steady.py), kept up
   or not by the steady phase's rules.

Every step records the CPU seconds of each process group while it ran (load_gen from wait4; the
Postgres backends, the walsender and Valkey from /proc/PID/schedstat; the relay from
/proc/PID/stat) and the machine's busy time, so the report can say which one ran out: a
single-threaded process at ~100% of a core, or the machine's cores all busy.
"""

from __future__ import annotations

import math
import subprocess
import time

from harness import (Env, create_slot, current_lsn, log, proc_cpu_seconds, thread_siblings,
                     wait_sent)
from send_lag import SendLag, verdict
from steady import load, run_steady


def load_window(g: dict, rate: int, launched: float, returned: float) -> tuple[float, float]:
    """The load's own window from load_gen's summary `g`, on the monotonic clock the send-lag
    probe's samples are on; `launched` and `returned` bracket load_gen's run on this process's
    clock. Fails if load_gen inserted nothing, or if the window is not within its run: that
    catches a load_gen on another clock, not an error of milliseconds."""
    start, end = g["load_start_monotonic_s"], g["load_end_monotonic_s"]
    if not g["inserted"]:
        raise RuntimeError(f"load_gen inserted nothing in the {rate:,}/s step")
    if not launched < start < end < returned:
        raise RuntimeError(f"load_gen's load ({start:.3f} to {end:.3f} s) is not within "
                           f"its run ({launched:.3f} to {returned:.3f} s): not this "
                           "process's monotonic clock?")
    return start, end


def insert_only(env: Env, rates: list[int]) -> list[dict]:
    """load_gen at each rate into a database nobody streams from, until it falls short."""
    url = env.fresh_db("bench_ceiling_insert")
    steps = []
    try:
        with env.admin() as c:
            c.execute("CHECKPOINT")
        for rate in rates:
            rows = env.workdir / f"insert-{rate}.tsv"
            sampler = env.cpu_sampler()
            g = load(env, url, rate, env.a.step_seconds, rows)
            servers = sampler.stop()
            rows.unlink(missing_ok=True)
            held = g["achieved_rate"] >= 0.95 * rate
            steps.append({"target": rate, "achieved": g["achieved_rate"],
                          "events": int(g["inserted"]), "connections": g["connections"],
                          "load_gen_cpu_s": g["cpu_s"], "servers": servers, "kept_up": held})
            log(f"    insert only: {g['achieved_rate']:,.0f}/s of {rate:,}/s")
            if not held:
                break
    finally:
        env.drop_db("bench_ceiling_insert")
    return steps


def with_recvlogical(env: Env, rates: list[int]) -> list[dict]:
    """load_gen at each rate while pg_recvlogical streams the slot to /dev/null, until a rate is
    not held: the load falls short, the walsender has not sent the step's commits within
    --max-p99-ms of the load's end (the bound the relay's p99 must keep to be held), or its send
    lag during the load (bench/send_lag.py, a lower bound on the consumer's latency) failed the
    relay's rules: p99 over --max-p99-ms or a drift over --max-drift-ms."""
    name = "bench_ceiling_rl"
    url = env.fresh_db(name)
    create_slot(url, name)
    catch_up = env.a.max_p99_ms / 1000
    err_path = env.workdir / f"{name}.log"
    p = subprocess.Popen(
        [env.a.pg_recvlogical, "-d", url, "--slot", name, "--start", "-o", "proto_version=1",
         "-o", "publication_names=outbox_relay", "-f", "/dev/null", "-s", "1", "--no-loop"],
        stdout=subprocess.DEVNULL, stderr=open(err_path, "w"), preexec_fn=env.consumer_preexec())

    def alive() -> None:
        if p.poll() is not None:
            raise RuntimeError(f"pg_recvlogical exited ({p.returncode}); see {err_path}")

    steps = []
    try:
        if math.isnan(wait_sent(url, name, current_lsn(url), 30.0, check=alive)[0]):
            raise RuntimeError("pg_recvlogical did not start streaming within 30 s")
        with env.admin() as c:
            c.execute("CHECKPOINT")
        for rate in rates:
            rows = env.workdir / f"recvlogical-{rate}.tsv"
            sampler = env.cpu_sampler()
            cpu0 = proc_cpu_seconds(p.pid)
            probe = SendLag(url, name)
            try:
                try:
                    launched = time.monotonic()
                    g = load(env, url, rate, env.a.step_seconds, rows)
                    returned = time.monotonic()
                    caught_up = wait_sent(url, name, current_lsn(url), catch_up, check=alive)[0]
                except BaseException:
                    probe.stop(raise_error=False)  # the step's error is the one to report
                    raise
                probe.stop()
                alive()
                servers = sampler.stop()
            finally:
                probe_cpu = probe.close()
            cpu = proc_cpu_seconds(p.pid) - cpu0
            rows.unlink(missing_ok=True)
            start, end = load_window(g, rate, launched, returned)
            lag = verdict(probe.lags_ms(start, end))
            if not lag["lag_samples"]:
                raise RuntimeError(f"send-lag probe: no sample during the {rate:,}/s step")
            held = (g["achieved_rate"] >= 0.95 * rate and not math.isnan(caught_up)
                    and lag["lag_p99_ms"] <= env.a.max_p99_ms
                    and lag["lag_drift_ms"] <= env.a.max_drift_ms)
            steps.append({"target": rate, "achieved": g["achieved_rate"],
                          "events": int(g["inserted"]), "connections": g["connections"],
                          "load_gen_cpu_s": g["cpu_s"], "servers": servers, "kept_up": held,
                          "relay_cpu_s": cpu, "caught_up_s": caught_up,
                          "probe_cpu_s": probe_cpu, **lag})
            log(f"    with pg_recvlogical: {g['achieved_rate']:,.0f}/s of {rate:,}/s, "
                f"sent {caught_up:.2f} s after the load stopped; send lag p50 "
                f"{lag['lag_p50_ms']:.1f} ms, p99 {lag['lag_p99_ms']:.1f} ms, drift "
                f"{lag['lag_drift_ms']:.1f} ms ({lag['lag_samples']} samples)")
            if not held:
                break
    finally:
        p.kill()
        p.wait()
        env.drop_db(name)
    return steps


def phase_ceiling(env: Env) -> dict:
    rates = [int(x) for x in env.a.ceiling_rates.split(",") if x]
    log(f"phase ceiling: {env.a.ceiling_rates} /s, {env.a.step_seconds:g} s steps")
    try:
        if env.a.ceiling_cpu_split:
            env.split_cpus()
        log("  Postgres alone (no slot, no relay)")
        alone = insert_only(env, rates)
        log("  with pg_recvlogical streaming (logical decoding, no sink)")
        decoding = with_recvlogical(env, rates)
        log("  with the relay streaming")
        stream = run_steady(env, "bench_ceiling", [], rates)
        split = [sorted(side) for side in env.split] if env.split else None
        shared = (sorted(c for c in split[1] if thread_siblings(c) & set(split[0]))
                  if split else [])
    finally:
        env.unsplit_cpus()
    return {"insert_only": alone, "recvlogical": decoding, "stream": stream, "cpu_split": split,
            "cpu_split_shared_cores": shared}


def cores(step: dict) -> dict[str, float]:
    """CPU of each process group during a step, in cores (CPU seconds per second of the step)."""
    sv = step["servers"]
    span = sv["span_s"] or float("nan")
    out = {
        "load_gen": step["load_gen_cpu_s"] / span,
        # Without the send-lag probe's backend (pg_recvlogical's steps), which the other ramps
        # do not have.
        "backends": (sv.get("cpu_pg_backend_s", 0.0) + sv.get("cpu_pg_background_s", 0.0)
                     - step.get("probe_cpu_s", 0.0)) / span,
        "walsender": sv.get("cpu_walsender_s", 0.0) / span,
        "walsender_wait": sv.get("wait_walsender_s", 0.0) / span,
        "relay": step.get("relay_cpu_s", 0.0) / span,
        "valkey": sv.get("cpu_valkey_s", 0.0) / span,
        "busy": sv["machine_busy_s"] / span,
        "top": sv.get("top_server_s", 0.0) / span,
    }
    out["other"] = max(0.0, out["busy"] - sum(out[k] for k in (
        "load_gen", "backends", "walsender", "relay", "valkey")))
    return out
