"""Loss memory and time, forward + backward, at Qwen3.5's vocabulary (issue 5, benchmark 1).

(a) From logits (N, V): this project's top-k JSD + utility terms on whole logits
    (`opd.maths.chunked.topk_jsd_from_logits`, as `opd.methods.objective` runs it with loss_chunk 0; the same values as
    `topk_support` + `generalized_jsd` + `utility_terms`) against a peer's full-vocabulary loss on the same inputs: TRL's
    `generalized_jsd_loss` (beta 0.5), the loss of TRL's GKD trainer (requirements-bench.txt).
(b) From final hidden states (N, H) through the LM head (V, H): the chunked path
    (`opd.maths.chunked.budgeted_loss_from_hidden`) against the same loss on whole logits (h @ W^T, then (a)'s
    plain path), and the LM-head matrix products alone (student h W^T, teacher h W^T, and the two
    backward products dZ W and dZ^T h), the floor any implementation pays.

Each case runs in a fresh interpreter. Memory is the peak resident set above the inputs (logits, or
hidden states and weights) *and* the gradients the backward leaves (their .grad), i.e. what the loss
itself holds at its peak. Time is the median of a few forward + backward calls after one warm-up
call on the first `--warmup-positions` positions. A case whose estimated memory exceeds --rss-cap-gb
is not run and reported as "does not fit" with the estimate (the estimate extrapolates the same
method's measurement at a smaller N when there is one).

    .venv/bin/python bench/loss_memory.py --out bench-loss.json          # the recorded CPU run
    .venv/bin/python bench/loss_memory.py --quick                        # toy sizes, seconds
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._util import (
    GB,
    PeakMemory,
    add_run_args,
    fmt_bytes,
    fmt_ratio,
    fmt_s,
    format_machine,
    markdown_table,
    median,
    met,
    run_case,
    start,
    time_repeats,
    write_json,
)

QWEN35_VOCAB = 248_320
QWEN35_4B_HIDDEN = 2_560
PROCESS_OVERHEAD = int(1.2 * GB)  # interpreter, torch (and trl) before any tensor; used by the estimate only

# Static estimates of the peak above inputs + gradients, in units of one (N, V) float32 tensor, used
# before a method has been measured at a smaller N. Deliberately high: they only decide what is run.
STATIC_NV = {"peer": 12.0, "ours": 5.0, "whole": 7.0, "products": 2.0, "chunked": 7.0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--mode",
        choices=["logits", "hidden", "both"],
        default="both",
        help="(a) from logits, (b) from hidden states, or both (default: both)",
    )
    p.add_argument(
        "--positions",
        default="256,512,2048",
        help="comma-separated N, the response positions of one loss call (default: 256,512,2048)",
    )
    p.add_argument("--vocab", type=int, default=QWEN35_VOCAB, help="vocabulary size V (default: Qwen3.5's 248,320)")
    p.add_argument(
        "--hidden", type=int, default=QWEN35_4B_HIDDEN, help="hidden size H of (b) (default: Qwen3.5-4B's 2,560)"
    )
    p.add_argument("--topk", type=int, default=100, help="top-k support of this project's loss (default: 100)")
    p.add_argument("--alpha", type=float, default=0.5, help="JSD mixture weight; the peer's beta (default: 0.5)")
    p.add_argument(
        "--chunks", default="256,512", help="comma-separated loss_chunk values of the chunked path (default: 256,512)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed forward + backward calls per case, median reported (default: 3)"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="stop a case's timed calls once they have taken this long, after at least one (default: 240; 0 = no limit)",
    )
    p.add_argument(
        "--warmup-positions",
        type=int,
        default=256,
        help="the untimed warm-up call runs on the first min(N, this) positions (default: 256)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto = cuda when available (default: auto)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="dtype of logits, hidden states and weights: float32, bfloat16, or auto = bfloat16 on cuda, float32 on cpu",
    )
    p.add_argument(
        "--rss-cap-gb",
        type=float,
        default=14.0,
        help="largest estimated resident set of a case; larger cases are reported as not fitting, and a case "
        "whose resident set passes it is killed (default: 14; on cuda the cap is 90%% of the GPU's memory)",
    )
    p.add_argument(
        "--separate-teacher-head",
        action="store_true",
        help="(b): give the teacher its own LM-head tensor; by default it shares the student's storage "
        "(the same products, 2.5 GB less baseline at H 2,560)",
    )
    p.add_argument("--no-peer", action="store_true", help="skip the peer (TRL) cases")
    add_run_args(p, mixed_precision=False, what="case")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="toy sizes (V 2,000, H 64, N 16/32/64, chunk 16, one repeat, in process) for a smoke test",
    )
    p.add_argument("--out", default=None, help="write the measured numbers to this JSON file")
    a = p.parse_args(argv)
    if a.quick:  # toy sizes where the flag was left at its default
        quick = {
            "vocab": 2000,
            "hidden": 64,
            "positions": "16,32,64",
            "chunks": "16",
            "repeats": 1,
            "warmup_positions": 16,
            "in_process": True,
        }
        for key, value in quick.items():
            if getattr(a, key) == p.get_default(key):
                setattr(a, key, value)
    return a


def resolve_device(device: str, dtype: str) -> tuple[str, str]:
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def load_peer():
    """TRL's generalized_jsd_loss (GKD trainer; a static method), or None when trl is not installed."""
    import warnings

    for module in ("trl.experimental.gkd.gkd_trainer", "trl.trainer.gkd_trainer"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "importing from trl.experimental"
                return __import__(module, fromlist=["GKDTrainer"]).GKDTrainer.generalized_jsd_loss
        except (ImportError, AttributeError):
            continue
    return None


# ------------------------------------------------------------------------------------------- one case


def case(
    mode: str, method: str, n: int, vocab: int, hidden: int, topk: int, alpha: float, chunk: int, repeats: int,
    budget_s: float, warmup_positions: int, device: str, dtype: str, seed: int, separate_teacher_head: bool,
) -> dict:  # fmt: skip
    """Builds one case's inputs, warms up, and measures peak memory and time of forward + backward."""
    import torch

    from opd.maths.chunked import budgeted_loss_from_hidden, topk_jsd_from_logits

    dt = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    peer = load_peer() if method == "peer" else None

    def plain_loss(z_s, z_t):
        """This project's loss on whole logits (opd.methods.micro_batch.micro_batch_loss, loss_chunk 0): Eq. 3, 7-8."""
        d_alpha, terms = topk_jsd_from_logits(z_s, z_t, topk, alpha)  # (P,), (P, 3)
        return d_alpha.mean(), terms

    if mode == "logits":
        s = (2.0 * torch.randn(n, vocab, generator=gen, device=device)).to(dt).requires_grad_(True)
        t = (s.detach() + torch.randn(n, vocab, generator=gen, device=device)).to(dt)
        leaves = [s]

        def step(m):
            if method == "peer":
                loss = peer(s[:m].unsqueeze(0), t[:m].unsqueeze(0), beta=alpha)  # (1, P, V), batchmean
            else:
                loss, _ = plain_loss(s[:m], t[:m])
            loss.backward()

    else:
        w_s = (0.02 * torch.randn(vocab, hidden, generator=gen, device=device)).to(dt).requires_grad_(True)
        w_t = (
            (w_s.detach() + 0.002 * torch.randn(vocab, hidden, generator=gen, device=device)).to(dt)
            if separate_teacher_head
            else w_s.detach()
        )
        h_s = torch.randn(n, hidden, generator=gen, device=device).to(dt).requires_grad_(True)
        h_t = (h_s.detach() + 0.5 * torch.randn(n, hidden, generator=gen, device=device)).to(dt)
        leaves = [w_s, h_s]
        dz = torch.randn(n, vocab, generator=gen, device=device).to(dt) if method == "products" else None

        def step(m):
            if method == "chunked":
                weights = torch.full((m,), 1.0 / m, device=device)  # the token mean of Eq. 11
                loss, _, _ = budgeted_loss_from_hidden(h_s[:m], w_s, h_t[:m], w_t, weights, topk, alpha, chunk)
                loss.backward()
            elif method == "whole":
                z_s = h_s[:m] @ w_s.T  # (P, V)
                with torch.no_grad():
                    z_t = h_t[:m] @ w_t.T
                loss, _ = plain_loss(z_s, z_t)
                loss.backward()
            else:  # the LM-head products alone: two forwards, the two backward products
                with torch.no_grad():
                    z_s = h_s[:m] @ w_s.T
                    del z_s
                    z_t = h_t[:m] @ w_t.T
                    del z_t
                    grad_w = dz[:m].T @ h_s[:m]  # (V, H)
                    grad_h = dz[:m] @ w_s  # (P, H)
                    del grad_w, grad_h

    def run(m):
        step(m)
        for x in leaves:
            x.grad = None

    run(min(n, warmup_positions))  # warm-up
    pm = PeakMemory(device)
    baseline = pm.start()
    times = time_repeats(lambda: run(n), repeats, budget_s, device)
    grad_bytes = sum(x.numel() * x.element_size() for x in leaves)
    if method == "products":
        grad_bytes = w_s.numel() * w_s.element_size() + n * hidden * h_s.element_size()
    peak = pm.peak_above()
    return {
        "mode": mode, "method": method, "n": n, "chunk": chunk, "status": "ok",
        "baseline_bytes": baseline, "grad_bytes": grad_bytes, "peak_above_baseline_bytes": peak,
        "extra_bytes": max(0, peak - grad_bytes), "times_s": times, "median_s": median(times),
        "memory_method": pm.method,
    }  # fmt: skip


# --------------------------------------------------------------------------------------------- driver


def estimate(
    mode: str, method: str, n: int, chunk: int, a: argparse.Namespace, elem: int, measured: list[dict]
) -> tuple[int, int]:
    """(estimated total resident bytes, estimated extra bytes) of a case before it runs."""
    nv = n * a.vocab * 4  # the loss upcasts to float32
    vh = a.vocab * a.hidden * elem
    if mode == "logits":
        inputs, grads = 2 * n * a.vocab * elem, n * a.vocab * elem
    else:
        inputs = vh * (2 if a.separate_teacher_head else 1) + 2 * n * a.hidden * elem
        inputs += n * a.vocab * elem if method == "products" else 0
        grads = vh + n * a.hidden * elem
    if method == "chunked":
        c = min(n, chunk)
        extra = STATIC_NV["chunked"] * c * a.vocab * 4 + (vh if n > chunk else 0)
    else:
        extra = STATIC_NV[method] * nv
    same = [r for r in measured if r["method"] == method and r["chunk"] == chunk and r["status"] == "ok"]
    if same:
        ref = max(same, key=lambda r: r["n"])
        if method == "chunked":
            extra = ref["extra_bytes"] if ref["n"] > chunk or n <= chunk else extra
        else:
            extra = ref["extra_bytes"] * n / ref["n"]
    return int(PROCESS_OVERHEAD + inputs + grads + extra), int(extra)


def plan(a: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(mode, method, chunk) of every case, in the order they run (each over ascending N)."""
    cases = []
    if a.mode in ("logits", "both"):
        cases.append(("logits", "ours", 0))
        if not a.no_peer:
            cases.append(("logits", "peer", 0))
    if a.mode in ("hidden", "both"):
        cases += [("hidden", "chunked", int(c)) for c in a.chunks.split(",")]
        cases += [("hidden", "whole", 0), ("hidden", "products", 0)]
    return cases


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch

    device, dtype = resolve_device(a.device, a.dtype)
    info = start(a.wait_quiet, device, a.threads)
    positions = sorted(int(x) for x in a.positions.split(","))
    elem = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    cap = int(a.rss_cap_gb * GB)
    if device.startswith("cuda"):
        cap = int(0.9 * torch.cuda.get_device_properties(torch.device(device)).total_memory)
    if a.no_peer or a.mode == "hidden":
        peer_available = False
    else:  # importing trl takes seconds: in fresh processes only the child imports it
        peer_available = load_peer() is not None if a.in_process else _peer_importable()
    results = []
    for mode, method, chunk in plan(a):
        for n in positions:
            if method == "peer" and not peer_available:
                results.append({"mode": mode, "method": method, "n": n, "chunk": chunk, "status": "trl not installed"})
                continue
            est_total, est_extra = estimate(mode, method, n, chunk, a, elem, results)
            if est_total > cap:
                results.append({"mode": mode, "method": method, "n": n, "chunk": chunk, "status": "does not fit",
                                "est_total_bytes": est_total, "est_extra_bytes": est_extra})  # fmt: skip
                print(
                    f"{mode}/{method} N={n}: does not fit (estimated {fmt_bytes(est_total)} > {fmt_bytes(cap)})",
                    file=sys.stderr,
                )
                continue
            kwargs = {
                "mode": mode, "method": method, "n": n, "vocab": a.vocab, "hidden": a.hidden, "topk": a.topk, "alpha": a.alpha, "chunk": chunk,
                "repeats": a.repeats, "budget_s": a.budget_s, "warmup_positions": a.warmup_positions, "device": device, "dtype": dtype,
                "seed": a.seed, "separate_teacher_head": a.separate_teacher_head,
            }  # fmt: skip
            print(
                f"{mode}/{method} chunk={chunk} N={n}: running (estimated {fmt_bytes(est_total)})",
                file=sys.stderr,
                flush=True,
            )
            r = run_case("bench.loss_memory:case", kwargs, isolated=not a.in_process, threads=a.threads,
                         rss_cap_bytes=0 if device.startswith("cuda") else cap)  # fmt: skip
            if "error" in r:
                r = {
                    "mode": mode,
                    "method": method,
                    "n": n,
                    "chunk": chunk,
                    "status": r["error"],
                    "est_total_bytes": est_total,
                }
            r["est_total_bytes"], r["est_extra_bytes"] = est_total, est_extra
            results.append(r)
            print(
                f"  -> {r['status']} {fmt_bytes(r.get('extra_bytes'))} {fmt_s(r.get('median_s'))}",
                file=sys.stderr,
                flush=True,
            )
    report = summarize(results, a, positions, info, dtype)
    print(report["markdown"])
    write_json(a.out, {"machine": info, "args": vars(a), "dtype": dtype, "results": results, "targets": report["targets"],
                       "command": "python bench/loss_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])})  # fmt: skip
    return report


def _peer_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def _get(results, mode, method, n, chunk=0):
    for r in results:
        if r["mode"] == mode and r["method"] == method and r["n"] == n and r["chunk"] == chunk:
            return r
    return None


def _mem_cell(r) -> str:
    if r is None:
        return "-"
    if r["status"] == "ok":
        return fmt_bytes(r["extra_bytes"])
    if r["status"] == "does not fit":
        return f"does not fit (est. {fmt_bytes(r['est_extra_bytes'])} above inputs, {fmt_bytes(r['est_total_bytes'])} total)"
    return r["status"]


def _time_cell(r) -> str:
    if r is None or r["status"] != "ok":
        return "-"
    return fmt_s(r["median_s"]) + (f" ({len(r['times_s'])}x)" if len(r["times_s"]) != 1 else " (1x)")


def _ok(r) -> bool:
    return r is not None and r["status"] == "ok"


def summarize(results: list[dict], a, positions: list[int], info: dict, dtype: str) -> dict:
    out, targets = [format_machine(info), ""], {}
    if a.mode in ("logits", "both"):
        rows = []
        for n in positions:
            ours, peer = _get(results, "logits", "ours", n), _get(results, "logits", "peer", n)
            mem = peer["extra_bytes"] / max(1, ours["extra_bytes"]) if _ok(ours) and _ok(peer) else None
            spd = peer["median_s"] / ours["median_s"] if _ok(ours) and _ok(peer) else None
            rows.append(
                [
                    f"{n:,}",
                    _mem_cell(ours),
                    _mem_cell(peer),
                    fmt_ratio(mem, 1),
                    _time_cell(ours),
                    _time_cell(peer),
                    fmt_ratio(spd, 1),
                ]
            )
        out += [
            (f"(a) Loss from logits, forward + backward, V = {a.vocab:,}, {dtype}: this project's top-{a.topk} JSD + utility "
            "terms (plain path) vs TRL `generalized_jsd_loss` (beta 0.5). Memory: peak above the logits and their gradient."),
            "",
            markdown_table(["N", "ours: peak memory", "peer: peak memory", "peer / ours memory", "ours: time", "peer: time", "peer / ours time"], rows),
            "",
        ]  # fmt: skip
        mem_ok = [(_get(results, "logits", "peer", n)["extra_bytes"] / max(1, _get(results, "logits", "ours", n)["extra_bytes"]))
                  for n in positions if _ok(_get(results, "logits", "ours", n)) and _ok(_get(results, "logits", "peer", n))]  # fmt: skip
        targets["logits_memory_at_most_tenth"] = {
            "peer_over_ours": mem_ok,
            "met": (min(mem_ok) >= 10) if mem_ok else None,
        }
        n512 = 512 if 512 in positions else positions[len(positions) // 2]
        o, p = _get(results, "logits", "ours", n512), _get(results, "logits", "peer", n512)
        spd = p["median_s"] / o["median_s"] if _ok(o) and _ok(p) else None
        targets["logits_5x_faster_at_512"] = {"n": n512, "speedup": spd, "met": None if spd is None else spd >= 5}
        out += [
            (f"- Target: peak memory at most 1/10 of the peer's: {met(targets['logits_memory_at_most_tenth']['met'])} "
            f"(peer / ours = {', '.join(f'{x:.1f}x' for x in mem_ok) or '-'})."),
            f"- Target: at least 5x faster than the peer at N = {n512}: {met(targets['logits_5x_faster_at_512']['met'])} ({fmt_ratio(spd, 1)}).",
            "",
        ]  # fmt: skip
    if a.mode in ("hidden", "both"):
        chunks = [int(c) for c in a.chunks.split(",")]
        head = ["N"] + [f"chunked {c}: peak memory" for c in chunks] + ["whole logits: peak memory"]
        head += [f"chunked {c}: time" for c in chunks] + [
            "whole logits: time",
            "LM-head products alone",
            "chunked / products (" + " / ".join(str(c) for c in chunks) + ")",
            "whole / products",
        ]
        rows, ratios, flat = [], {}, {}
        for n in positions:
            ch = [_get(results, "hidden", "chunked", n, c) for c in chunks]
            whole, prod = _get(results, "hidden", "whole", n), _get(results, "hidden", "products", n)
            rat = [r["median_s"] / prod["median_s"] for r in ch if _ok(r) and _ok(prod)]
            ratios[n] = rat
            rows.append([f"{n:,}", *[_mem_cell(r) for r in ch], _mem_cell(whole), *[_time_cell(r) for r in ch], _time_cell(whole),
                         _time_cell(prod), " / ".join(fmt_ratio(x) for x in rat) or "-",
                         fmt_ratio(whole["median_s"] / prod["median_s"] if _ok(whole) and _ok(prod) else None)])  # fmt: skip
        for c in chunks:
            beyond = [_get(results, "hidden", "chunked", n, c) for n in positions if n > c]
            vals = [r["extra_bytes"] for r in beyond if _ok(r)]
            flat[c] = {"n": [n for n in positions if n > c], "extra_bytes": vals,
                       "met": (max(vals) <= 1.1 * min(vals) + 64 * 1024**2) if len(vals) >= 2 else None}  # fmt: skip
        all_rat = [x for v in ratios.values() for x in v]
        targets["hidden_memory_flat_beyond_one_chunk"] = flat
        targets["hidden_time_within_1_2x_products"] = {
            "ratios": ratios,
            "met": (max(all_rat) <= 1.2) if all_rat else None,
        }
        out += [
            (f"(b) Loss from final hidden states (H = {a.hidden:,}) through the LM head (V = {a.vocab:,}), forward + backward, {dtype}: "
            "`budgeted_loss_from_hidden` vs the same loss on whole logits (h W^T, then the plain path). Memory: peak above the weights, "
            f"hidden states and their gradients ({'separate' if a.separate_teacher_head else 'shared'} teacher LM-head storage). "
            "Products alone: h_s W^T, h_t W^T, dZ W, dZ^T h."),
            "",
            markdown_table(head, rows),
            "",
        ]  # fmt: skip
        for c, f in flat.items():
            vals = ", ".join(f"N={n}: {fmt_bytes(v)}" for n, v in zip(f["n"], f["extra_bytes"]))
            out.append(
                f"- Target: peak memory flat in N beyond one chunk (chunk {c}): {met(f['met'])} ({vals or '-'})."
            )
        out.append(f"- Target: time within 1.2x of the LM-head products alone: {met(targets['hidden_time_within_1_2x_products']['met'])} "
                   f"(chunked / products = {', '.join(f'{x:.2f}x' for x in all_rat) or '-'}).")  # fmt: skip
        out.append("")
    return {"markdown": "\n".join(out), "targets": targets, "results": results}


if __name__ == "__main__":
    main()
