"""bench/cameras/cameras.py's results: `summarize`, every number of a run (what --json writes), and
`report`, the table it prints.

    result = summarize(args, plan, questions, skipped, sent, wall_s, client_cpu_s, server,
                       image_tokens, words, uploads)
    print(report(result))

The check (`encoded_once`): every distinct frame encoded exactly once, by the workers and the
encoder services together (`server["encoded"]`, bench/cameras/camera_metrics.py), against the
distinct frames the questions named -- or, in --upload mode with an encoder service's
/metrics read, every frame uploaded (an encoder encodes what is stored, asked about or not).
"""

from __future__ import annotations

from dataclasses import asdict

from bench.stack.serve import percentiles


def summarize(args, plan, questions: list, skipped, sent, wall_s: float, client_cpu_s: float,
              server: dict, image_tokens: list[int], words: list[tuple[int, int]],
              uploads=None) -> dict:
    """`questions`: bench/cameras/cameras.py's Question of each sent; `uploads`: --upload's CameraUploads."""
    ok = [q for q in questions if q.error is None]
    distinct = sum(len({i for q in questions if q.camera == k
                        for i in range(max(0, q.newest_frame - args.frames + 1), q.newest_frame + 1)})
                   for k in range(args.cameras)) if not args.text_only else 0
    mode = "text-only" if args.text_only else "no-uuid" if args.no_uuid else "upload" if args.upload else "uuid"
    sent_files = uploads.summary(pctl) if uploads is not None else {}
    # what must have been encoded: the frames the questions named; with encoder services,
    # every frame uploaded (they encode what is stored, asked about or not)
    to_encode = sent_files["frames_uploaded"] if uploads is not None and server.get("encoded_by_encoders") \
        is not None else distinct
    encoded = server.get("encoded")

    def share(seconds):
        return seconds / wall_s if seconds is not None else None

    return {
        "mode": mode, "seed": args.seed, "base_url": args.base_url, "model": args.model,
        "cameras": args.cameras, "fps": args.fps, "ask_every_s": args.ask_every, "frames_per_question": args.frames,
        "duration_s": args.duration, "frame_size": [args.width, args.height], "max_tokens": args.max_tokens,
        "wall_s": wall_s, "client_cpu_s": client_cpu_s,
        "questions_scheduled": len(plan), "questions_sent": len(questions), "questions_skipped": len(skipped),
        "questions_failed": len(questions) - len(ok), "questions_answered_per_s": len(ok) / wall_s,
        "errors": sorted({q.error for q in questions if q.error})[:5],
        "skipped_per_camera": [sum(1 for k, _ in skipped if k == c) for c in range(args.cameras)],
        "ttft_s": pctl([q.ttft_s for q in ok]), "latency_s": pctl([q.latency_s for q in ok]),
        "send_lag_s": pctl([q.lag_s for q in questions]),
        "prompt_tokens_mean": sum(q.prompt_tokens for q in ok) / len(ok) if ok else None,
        "warmup_image_prompt_tokens": image_tokens,
        "text_filler": [{"words": w, "tokens": n} for w, n in words],
        "output_tokens": sum(q.output_tokens for q in ok),
        "frames_distinct": distinct, "frames_with_data": sum(q.with_data for q in questions),
        "frames_by_uuid": sum(q.by_uuid for q in questions),
        "frames_by_file": sum(q.by_file for q in questions), "frames_missing": sum(q.missing for q in questions),
        "upload_mb": sum(q.upload_bytes for q in questions) / 1e6,
        "frame_kb_mean": (sum(q.upload_bytes for q in questions) / max(1, sum(q.with_data for q in questions))
                          * 3 / 4 / 1e3),  # base64 → JPEG bytes
        "upload_wait_s": pctl([q.upload_wait_s for q in questions]) if uploads is not None else {},
        **{k: v for k, v in sent_files.items() if k != "uploads"},
        "server": server,
        "encoder_busy_share": share(server.get("encoder_s")),  # the workers' encoding
        "encoders_busy_share": share(server.get("encoders_s")),  # the encoder services'
        # of the frames the workers' steps needed, those ready (their encoder cache, or published)
        "ready_share": (server["mm_ready"] / server["mm_queries"]) if server.get("mm_queries") else None,
        "frames_to_encode": to_encode,
        "encoded_once": (encoded == to_encode) if encoded is not None and not args.text_only else None,
        "args": vars(args) | {"api_key": None},
        "questions": [asdict(q) for q in questions],
        "uploads": sent_files.get("uploads", []),
    }


def pctl(values: list[float]) -> dict[str, float]:
    """bench/stack/serve.py's percentiles, and the max (a robot's deadline is about the worst)."""
    return {**percentiles(values), "max": max(values)} if values else {}


def report(r: dict) -> str:
    s = r["server"]

    def ms(d: dict) -> str:
        return "  ".join(f"{k} {v * 1000:7.0f} ms" for k, v in d.items()) if d else "-"

    def n(v) -> str:
        return "-" if v is None else f"{v:.0f}"

    def busy(seconds, share, count, what) -> str:
        return "-" if seconds is None else f"{seconds:.2f} s ({share:.0%} of the run) in {n(count)} {what}"

    upload = r["mode"] == "upload"
    uploaded = " uploaded" if upload and s["encoded_by_encoders"] is not None else ""  # what the check counts
    frames = ("none (text only)" if r["mode"] == "text-only" else
              f"{r['frames_distinct']} distinct, {r['frames_by_file']} named by file_id, {r['frames_missing']} "
              "left out (upload failed)" if upload else
              f"{r['frames_distinct']} distinct, {r['frames_with_data']} with data ({r['upload_mb']:.1f} MB base64, "
              f"{r['frame_kb_mean']:.1f} KB a JPEG), {r['frames_by_uuid']} by uuid")
    rows = [
        ("run", f"{r['mode']}: {r['cameras']} cameras x {r['fps']:g} fps, a question every {r['ask_every_s']:g} s "
                f"about the last {r['frames_per_question']} frames ({r['frame_size'][0]}x{r['frame_size'][1]}), "
                f"{r['duration_s']:g} s, {r['max_tokens']} tokens out, seed {r['seed']}"),
        ("questions", f"{r['questions_scheduled']} due, {r['questions_sent']} sent, {r['questions_skipped']} "
                      f"skipped (late), {r['questions_failed']} failed; {r['questions_answered_per_s']:.2f} "
                      f"answered/s over {r['wall_s']:.1f} s"),
        ("TTFT", ms(r["ttft_s"])), ("latency", ms(r["latency_s"])), ("send lag", ms(r["send_lag_s"])),
        ("prompt", f"{n(r['prompt_tokens_mean'])} tokens a question (mean)"),
        ("frames sent", frames),
    ]
    if upload:
        rows += [("uploads", f"{r['frames_uploaded']} frames uploaded ({r['upload_jpeg_mb']:.1f} MB of JPEG), "
                             f"{r['uploads_failed']} failed, {r['files_deleted']} files deleted after"),
                 ("upload", ms(r["upload_latency_s"])), ("upload lag", ms(r["upload_lag_s"])),
                 ("upload wait", ms(r["upload_wait_s"]))]
    rows += [
        ("gateway", f"{n(s['received'])} received (decoded), {n(s['stored'])} stored, {n(s['reused'])} reused, "
                    f"{n(s['by_uuid'])} by uuid" + (" (uploads are not counted here)" if upload else "")),
        ("workers", f"{n(s['encoded_by_workers'])} encoded, {n(s['mm_ready'])} of {n(s['mm_queries'])} frames "
                    f"needed ready (cached or published), {n(s['cache_hits'])} in their encoder cache; encoding "
                    + busy(s["encoder_s"], r["encoder_busy_share"], s["encoder_steps"], "steps")),
        ("encoders", "- (no encoder service's /metrics)" if s["encoded_by_encoders"] is None else
         f"{n(s['encoded_by_encoders'])} encoded, {n(s['published'])} published, {n(s['found_published'])} found "
         f"published, {n(s['encode_failed'])} failed, {n(s['encoder_queue_depth'])} jobs left; busy "
         + busy(s["encoders_s"], r["encoders_busy_share"], s["encoders_batches"], "batches")),
        ("check", "-" if r["encoded_once"] is None else
         f"every distinct frame encoded once: {'yes' if r['encoded_once'] else 'NO'} "
         f"({n(s['encoded'])} encoded: {n(s['encoded_by_workers'])} by workers + {n(s['encoded_by_encoders'])} by "
         f"encoders; {r['frames_to_encode']} distinct{uploaded})"),
        ("client", f"{r['client_cpu_s']:.2f} CPU-s over the run"),
    ]
    errors = r["errors"] + r.get("upload_errors", [])
    return "\n".join(f"{name:12s} {value}" for name, value in rows) + "".join(f"\nerror: {e}" for e in errors)
