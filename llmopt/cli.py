"""The `llmopt` command line: compile, inspect, generate, eval, bench, serve.

Only `compile` imports the compiler (torch, transformers); the other commands need
the runtime alone. Errors in what the user gave are one line on stderr, exit code 1;
set LLMOPT_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from llmopt.runtime.sampling_params import DEFAULT_MAX_TOKENS


def _one_line_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except KeyboardInterrupt:
            sys.exit(130)
        except BrokenPipeError:  # `llmopt generate ... | head`: the reader left; so do we
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(141)
        except Exception as exc:  # noqa: BLE001 - the CLI's boundary: report, do not crash
            if os.environ.get("LLMOPT_DEBUG"):
                raise
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            click.echo(f"error: {message}", err=True)
            sys.exit(1)

    return wrapper


class ThreadCount(click.ParamType):
    """Intra-op threads: 1 up to this machine's cores (more only spin against each other)."""

    name = "threads"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        count = click.INT.convert(value, param, ctx)
        cores = os.cpu_count() or 1
        if not 1 <= count <= cores:
            self.fail(f"{count} is not between 1 and this machine's {cores} cores", param, ctx)
        return count


class PositiveIntList(click.ParamType):
    """Comma-separated positive integers, e.g. batch sizes `1,8`."""

    name = "N,N,..."

    def convert(self, value: Any, param: Any, ctx: Any) -> list[int]:
        if isinstance(value, list):
            return value
        try:
            numbers = [int(part) for part in str(value).split(",") if part.strip()]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers", param, ctx)
        if not numbers or min(numbers) < 1:
            self.fail(f"{value!r} needs one or more integers >= 1", param, ctx)
        return numbers


POSITIVE = click.IntRange(min=1)
# compiler/hf_export.EXPORT_FORMATS, spelled here so a bad --format fails before torch loads
EXPORT_FORMATS = ("compressed-tensors", "gptq", "gptq_v2", "awq", "float")
THREADS = click.option("--threads", type=ThreadCount(), default=None,
                       help="ONNX Runtime intra-op threads (default: all cores).")
# runtime/native.KERNELS, spelled here so that --help does not import the runtime
KERNELS = click.option("--kernels", type=click.Choice(["onnxruntime", "native", "auto"]),
                       default="auto", show_default=True,
                       help="auto: llmopt's own decoder step for the lanes int4/int8 "
                            "artifacts it knows, ONNX Runtime elsewhere; native: insist on it "
                            "(an error where it cannot run); onnxruntime: never.")


class _OneLineUsageError(click.ClickException):
    """A bad argument or option, said in one line like every other error."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class _Commands(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:  # parsing a subcommand's arguments
            raise _OneLineUsageError(exc.format_message()) from None


def _quiet_third_party_progress() -> None:
    """transformers' and the hub's progress bars would interleave with the compile log."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so a half-written artifact's staging folder is removed."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


@click.group(cls=_Commands)
@click.version_option(package_name="llmopt")
def main() -> None:
    """Ahead-of-time LLM optimization compiler and paged, continuously batched runtime."""
    # Before anything imports tqdm (it reads its environment once): transformers' GGUF
    # loader calls tqdm directly, past transformers' own progress-bar switch.
    os.environ.setdefault("TQDM_DISABLE", "1")


@main.command("compile")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path),
              help="Artifact directory to write.")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Override a recipe value, e.g. --set target.weight_dtype=float16.")
@click.option("--dry-run", is_flag=True,
              help="Check the recipe, the pass order, the output folder and the model's "
                   "location, then stop: nothing is loaded or written.")
@_one_line_errors
def compile_command(recipe: Path, out: Path, overrides: tuple[str, ...], dry_run: bool) -> None:
    """Compile RECIPE (YAML) into an artifact directory."""
    import yaml

    _exit_on_sigterm()
    from llmopt.compiler.preflight import check_output_directory, check_recipe
    from llmopt.compiler.recipe import load_recipe, resolved_dict

    check_output_directory(out)  # needs no recipe; passes' options import torch
    resolved = load_recipe(recipe, list(overrides))  # before torch loads: errors in < 1 s
    click.echo("resolved recipe:")
    click.echo(yaml.safe_dump(resolved_dict(resolved), sort_keys=False).rstrip())
    ref = check_recipe(resolved, out)  # still before torch: the model and output named
    if dry_run:
        where = ref.location + (f"/{ref.gguf_file}" if ref.gguf_file else "")
        output = "an artifact, replaced at the end" if out.exists() else "new"
        click.echo(f"quality of lossy passes: {resolved.quality_source()}")
        click.echo(f"dry run: recipe valid, {len(resolved.passes)} pass(es) in a valid order, "
                   f"model at {where}, output {out} ({output}); nothing compiled")
        return
    _quiet_third_party_progress()
    from llmopt.compiler.kernel_forecast import kernel_forecast
    from llmopt.compiler.pipeline import compile_recipe

    compile_recipe(resolved, out, log=click.echo)
    for line in kernel_forecast(resolved, out):
        click.echo(line)


@main.command("export-hf")
@click.argument("source", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path),
              help="Hugging Face checkpoint directory to write (must not exist).")
@click.option("--format", "fmt", default="compressed-tensors", show_default=True,
              help="compressed-tensors (pack-quantized), gptq (v1), gptq_v2, awq (GEMM), or "
                   "float (dequantized float32: loads anywhere without flags).")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Override a recipe value, e.g. --set passes.0.rtn.bits=8 (recipes only).")
@_one_line_errors
def export_hf_command(source: Path, out: Path, fmt: str, overrides: tuple[str, ...]) -> None:
    """Write SOURCE as a Hugging Face checkpoint: a compiled artifact directory (its weights
    as compiled, in seconds) or a recipe YAML (its passes run again)."""
    from llmopt.runtime.manifest import MANIFEST_FILE

    _exit_on_sigterm()
    if fmt not in EXPORT_FORMATS:  # hf_export.check_format's words, before torch loads
        raise ValueError(f"unknown export format {fmt!r} (known: {', '.join(EXPORT_FORMATS)})")
    if out.exists():  # before any work: the export never replaces a folder
        raise FileExistsError(f"{out} exists; not replacing it")
    from_artifact = source.is_dir()
    if from_artifact and overrides:
        raise ValueError("--set overrides a recipe; SOURCE is a compiled artifact")
    if from_artifact and not (source / MANIFEST_FILE).is_file():
        raise ValueError(f"{source} is a folder but not an llmopt artifact ({MANIFEST_FILE} "
                         "is missing)")
    recipe = None
    if not from_artifact:
        from llmopt.compiler.recipe import load_recipe

        recipe = load_recipe(source, list(overrides))  # before torch loads
    _quiet_third_party_progress()
    from llmopt.compiler.hf_export import export_artifact, export_recipe, loading_hint

    if recipe is None:
        export_artifact(source, out, fmt, log=click.echo)
    else:
        export_recipe(recipe, out, fmt, log=click.echo)
    click.echo(loading_hint(out, fmt))


@main.command("inspect")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--pool-mib", type=click.FloatRange(min=0, min_open=True), default=1024.0,
              show_default=True,
              help="KV pool size for the 'tokens that fit' line.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_one_line_errors
def inspect_command(artifact: Path, pool_mib: float, as_json: bool) -> None:
    """Sizes, passes, KV bytes per token of ARTIFACT."""
    from llmopt.tools.inspect import describe, format_description

    info = describe(artifact, pool_mib)
    click.echo(json.dumps(info, indent=2) if as_json else format_description(info))


def _streaming_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--window and --sinks (StreamingLLM), --h2o (heavy hitters), for generate, bench and
    serve."""
    command = click.option("--h2o", type=POSITIVE, default=None, metavar="BUDGET",
                           help="Stream past the context keeping BUDGET entries per request: "
                                "the recent half and the heavy hitters by accumulated "
                                "attention (the native step; no speculation).")(command)
    command = click.option("--sinks", type=click.IntRange(min=0), default=4, show_default=True,
                           help="With --window: first positions every request keeps.")(command)
    return click.option("--window", type=POSITIVE, default=None,
                        help="Stream past the context: keep the sinks and the last WINDOW "
                             "positions of each request (lanes KV; no speculation).")(
        command)


def _streaming_kwargs(sinks: int, window: int | None, h2o: int | None) -> dict[str, Any]:
    """LLM's `streaming` argument from --sinks/--window or --h2o (none without either)."""
    if window is not None and h2o is not None:
        raise ValueError("choose one of --window and --h2o")
    if h2o is not None:
        from llmopt.runtime.kv.h2o import H2OConfig

        return {"streaming": H2OConfig(budget=h2o)}
    if window is None:
        return {}
    from llmopt.runtime.kv.streaming import StreamingConfig

    return {"streaming": StreamingConfig(sinks=sinks, window=window)}


def _speculation_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--speculative/--no-speculative, --gamma and --spec-max-batch, for generate, bench and
    serve."""
    options = [
        click.option("--speculative/--no-speculative", default=True, show_default=True,
                     help="Use the artifact's draft (when it has one)."),
        click.option("--gamma", type=click.IntRange(min=0), default=None,
                     help="Draft tokens per step (default: the compiler's choice)."),
        click.option("--spec-max-batch", type=POSITIVE, default=None,
                     help="Speculate only while at most this many sequences run "
                          "(default: the compiler's measured limit)."),
        click.option("--drafts", type=click.Choice(["all", "ngram", "model"]), default="all",
                     show_default=True, help="Which of the artifact's drafts to run."),
        click.option("--draft-tree", is_flag=True,
                     help="Suffix n-gram drafts as trees, several candidates per position "
                          "(needs the native step)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _speculation_kwargs(speculative: bool, gamma: int | None, spec_max_batch: int | None,
                        drafts: str, draft_tree: bool) -> dict[str, Any]:
    return {"speculative": speculative, "num_speculative_tokens": gamma,
            "speculative_max_batch_size": spec_max_batch, "drafts": drafts,
            "draft_tree": draft_tree}


@main.command("generate")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("prompts", nargs=-1, required=True)
@click.option("--chat", is_flag=True, help="Wrap each prompt in the chat template.")
@click.option("--max-tokens", type=POSITIVE, default=DEFAULT_MAX_TOKENS, show_default=True,
              help="Most new tokens per prompt.")
@click.option("--temperature", type=float, default=None,
              help="0 = greedy. Unset sampling options take the checkpoint's generation "
                   "config (greedy without one).")
@click.option("--top-p", type=float, default=None, help="Nucleus sampling mass, in (0, 1].")
@click.option("--top-k", type=int, default=None, help="Sample among the k likeliest (0: off).")
@click.option("--min-p", type=float, default=None,
              help="Drop tokens below this fraction of the likeliest's probability.")
@click.option("--repetition-penalty", type=float, default=None,
              help="> 1 discourages tokens already seen.")
@click.option("--seed", type=int, default=None, help="Sampling seed (reproducible output).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@THREADS
@KERNELS
@click.option("--num-blocks", type=POSITIVE, default=None, help="KV pool size in blocks.")
@click.option("--max-context", type=POSITIVE, default=None, help="Longest sequence, in tokens.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt and line.")
@_speculation_options
@_streaming_options
@_one_line_errors
def generate_command(artifact: Path, prompts: tuple[str, ...], chat: bool, max_tokens: int,
                     temperature: float | None, top_p: float | None, top_k: int | None,
                     min_p: float | None, repetition_penalty: float | None, seed: int | None,
                     stop: tuple[str, ...], threads: int | None, kernels: str,
                     num_blocks: int | None,
                     max_context: int | None, as_json: bool, speculative: bool,
                     gamma: int | None, spec_max_batch: int | None, drafts: str,
                     draft_tree: bool, sinks: int, window: int | None,
                     h2o: int | None) -> None:
    """Generate a continuation of each PROMPT, batched together."""
    from llmopt.runtime import LLM, SamplingParams

    for number, prompt in enumerate(prompts, 1):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # undecodable bytes in argv arrive as lone surrogates
            raise ValueError(f"prompt {number} is not valid UTF-8 text") from None
    chosen = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
              "repetition_penalty": repetition_penalty, "seed": seed}
    given = {k: v for k, v in chosen.items() if v is not None}
    SamplingParams(max_tokens=max_tokens, stop=list(stop), **given)  # bad values: before loading
    llm = LLM(artifact, num_threads=threads, num_blocks=num_blocks, max_context=max_context,
              kernels=kernels, **_streaming_kwargs(sinks, window, h2o),
              **_speculation_kwargs(speculative, gamma, spec_max_batch, drafts, draft_tree))
    params = SamplingParams.from_generation_config(  # the manifest's: transformers' defaults
        llm.manifest.generation, max_tokens=max_tokens, stop=list(stop), **given)
    outputs = llm.generate(list(prompts), params, chat=chat)
    if not as_json:  # after generating: an error stays the only line on stderr
        click.echo(llm.execution_summary(), err=True)
    for number, output in enumerate(outputs, 1):
        if not as_json and len(outputs) > 1:  # several outputs: say where each one starts
            click.echo(f"=== {number}/{len(outputs)} ===")
        if as_json:
            record = {"prompt": output.prompt, "text": output.text,
                      "token_ids": output.token_ids, "finish_reason": output.finish_reason,
                      "stop_reason": output.stop_reason,
                      "prompt_tokens": len(output.prompt_token_ids),
                      "prompt_token_ids": output.prompt_token_ids,
                      "ttft_ms": round(1000 * (output.metrics.ttft or 0.0), 3)}
            speculation = output.metrics.speculation
            if speculation is not None and speculation.num_spec_steps:
                record["speculation"] = speculation.to_dict(len(output.token_ids))
            click.echo(json.dumps(record))
        else:
            click.echo(output.text)
            if output.finish_reason == "length":  # a cut answer should not look finished
                click.echo(f"note: stopped at --max-tokens {max_tokens}; raise it for a "
                           "longer answer", err=True)


@main.command("eval")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--text", "text_files", required=True, multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="UTF-8 text to score (the protocol: tokenized once without BOS); "
                   "repeat for several texts, one row each.")
@click.option("--windows", type=POSITIVE, default=64, show_default=True,
              help="Non-overlapping windows scored (the first N).")
@click.option("--seq-len", type=POSITIVE, default=512, show_default=True,
              help="Tokens per window.")
@THREADS
@KERNELS
@click.option("--json", "as_json", is_flag=True, help="One JSON object per text.")
@_one_line_errors
def eval_command(artifact: Path, text_files: tuple[Path, ...], windows: int, seq_len: int,
                 threads: int | None, kernels: str, as_json: bool) -> None:
    """Perplexity of ARTIFACT on one or more text files, computed by the runtime."""
    from llmopt.runtime import LLM
    from llmopt.tools.evaluate import perplexity

    llm = LLM(artifact, num_threads=threads, max_num_batched_tokens=seq_len, kernels=kernels)
    results = []
    for text_file in text_files:
        result = perplexity(llm, text_file, windows=windows, seq_len=seq_len)
        results.append((text_file, result))
        if as_json:
            click.echo(json.dumps({**result.to_dict(), "text": str(text_file)}))
        elif len(text_files) == 1:
            click.echo(f"perplexity {result.ppl:.4f} over {result.tokens} tokens "
                       f"({result.windows} x {result.seq_len}, {result.seconds:.1f} s)")
    if not as_json and len(text_files) > 1:
        _perplexity_table(results)


def _perplexity_table(results: list[tuple[Path, Any]]) -> None:
    """One row per text: its perplexity, the tokens and windows scored, the time taken."""
    width = max(len(str(path)) for path, _ in results)
    click.echo(f"{'text':<{width}}  {'perplexity':>10}  {'tokens':>7}  {'windows':>9}  "
               f"{'seconds':>7}")
    for path, r in results:
        click.echo(f"{str(path):<{width}}  {r.ppl:>10.4f}  {r.tokens:>7}  "
                   f"{f'{r.windows} x {r.seq_len}':>9}  {r.seconds:>7.1f}")


@main.command("bench")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--batch", "batches", type=PositiveIntList(), default="1,8", show_default=True,
              help="Comma-separated batch sizes.")
@click.option("--prompt-len", type=POSITIVE, default=128, show_default=True,
              help="Prompt tokens per sequence.")
@click.option("--gen-len", type=POSITIVE, default=128, show_default=True,
              help="New tokens per sequence.")
@THREADS
@KERNELS
@click.option("--pool-mib", type=click.FloatRange(min=0, min_open=True), default=256.0,
              show_default=True, help="KV pool size for the 'sequences that fit' line.")
@click.option("--prompts", "prompts_kind", type=click.Choice(["auto", "text", "random"]),
              default="auto", show_default=True,
              help="text: built-in English passages; random: random token ids (they flatter "
                   "speculation); auto: text when the artifact speculates, else random.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per batch size.")
@_speculation_options
@_streaming_options
@_one_line_errors
def bench_command(artifact: Path, batches: list[int], prompt_len: int, gen_len: int,
                  threads: int | None, kernels: str, pool_mib: float, prompts_kind: str,
                  as_json: bool,
                  speculative: bool, gamma: int | None, spec_max_batch: int | None,
                  drafts: str, draft_tree: bool, sinks: int, window: int | None,
                  h2o: int | None) -> None:
    """TTFT, decode tok/s per stream, aggregate tok/s, peak RSS (with a draft, also
    acceptance rate and tokens per target step)."""
    from llmopt.runtime import LLM
    from llmopt.tools.bench import prompt_kind, run_bench

    streaming = _streaming_kwargs(sinks, window, h2o)  # lanes of the budget, not the run's length
    budget = h2o or (sinks + window if window else None)
    llm = LLM(artifact, num_threads=threads, max_num_seqs=max(batches),
              max_context=budget or prompt_len + gen_len + 1,
              kernels=kernels, **streaming,
              **_speculation_kwargs(speculative, gamma, spec_max_batch, drafts, draft_tree))
    kind = prompt_kind(prompts_kind, llm.engine.speculator is not None)
    run_bench(llm, 1, min(prompt_len, 16), 4)  # warm-up: session init, first-run allocations
    if not as_json:
        kv, context = llm.manifest.kv_cache, prompt_len + gen_len
        fits = kv.sequences_in_pool(pool_mib * 2**20, context, llm.manifest.runtime.block_size)
        click.echo(f"KV cache: {kv.bytes_per_token()} bytes/token; {fits} sequences of "
                   f"{context} tokens fit in {pool_mib:g} MiB")
        if kv.local_window():
            held = kv.bytes_per_sequence(context, llm.engine.config.block_size)
            click.echo(f"KV a sequence holds at {context} tokens: "
                       f"{held['full'] / 2**20:.2f} MiB full-attention layers + "
                       f"{held['sliding'] / 2**20:.2f} MiB sliding-window layers (window "
                       f"{kv.local_window()}; blocks behind it freed)")
        click.echo(f"prompts: {PROMPT_DESCRIPTIONS[kind]}")
        click.echo(f"kernels: {llm.kernels_in_use()}; threads: {llm.threads_in_use()}")
    for size in batches:
        result = run_bench(llm, size, prompt_len, gen_len, prompts_kind=kind)
        if as_json:
            click.echo(json.dumps(result.to_dict()))
        else:
            click.echo(f"batch {size:3d}: TTFT {result.ttft_ms:8.1f} ms, decode "
                       f"{result.decode_tok_s_per_stream:6.1f} tok/s/stream, aggregate "
                       f"{result.aggregate_tok_s:7.1f} tok/s (decode phase "
                       f"{result.decode_aggregate_tok_s:.1f}), peak RSS "
                       f"{result.peak_rss_mib:.0f} MiB" + _speculation_line(result))


@main.command("serve")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="TCP port to listen on.")
@click.option("--served-model-name", default=None,
              help="The model name clients send (default: the artifact directory's name).")
@click.option("--api-key", default=None, envvar="LLMOPT_API_KEY",
              help="Require 'Authorization: Bearer KEY' (or set LLMOPT_API_KEY).")
@THREADS
@KERNELS
@click.option("--max-num-seqs", type=POSITIVE, default=None, help="Most sequences per step.")
@click.option("--max-num-batched-tokens", type=POSITIVE, default=None,
              help="Per-step token budget.")
@click.option("--num-blocks", type=POSITIVE, default=None, help="KV pool size in blocks.")
@click.option("--max-context", type=POSITIVE, default=None, help="Longest sequence, in tokens.")
@click.option("--max-waiting", type=click.IntRange(min=0), default=256, show_default=True,
              help="Requests queued beyond the running batch; more get 503 + Retry-After.")
@click.option("--no-prefix-caching", is_flag=True, help="Turn the prefix cache off.")
@click.option("--grace-period", type=float, default=30.0, show_default=True,
              help="Seconds in-flight requests get to finish after SIGTERM.")
@_speculation_options
@_streaming_options
@_one_line_errors
def serve_command(artifact: Path, host: str, port: int, served_model_name: str | None,
                  api_key: str | None, threads: int | None, kernels: str, max_num_seqs: int | None,
                  max_num_batched_tokens: int | None, num_blocks: int | None,
                  max_context: int | None, max_waiting: int, no_prefix_caching: bool,
                  grace_period: float, speculative: bool, gamma: int | None,
                  spec_max_batch: int | None, drafts: str, draft_tree: bool, sinks: int,
                  window: int | None, h2o: int | None) -> None:
    """Serve ARTIFACT over an OpenAI-compatible HTTP API (needs the `serve` extra).

    Engine limits left unset take the artifact's recipe defaults.
    """
    try:
        from llmopt.runtime.serve.app import ServeConfig
        from llmopt.runtime.serve.server import listen_socket, serve
    except ImportError as exc:
        raise click.ClickException(
            f"{exc.name or exc} is missing: install the server with pip install 'llmopt[serve]'"
        ) from exc
    from llmopt.runtime.artifact import require_manifest_file

    config = ServeConfig(served_model_name or Path(artifact).resolve().name, api_key,
                         max_waiting)
    require_manifest_file(Path(artifact))
    try:
        listener = listen_socket(host, port)  # before the model loads: a busy port fails fast
    except OSError as exc:
        click.echo(f"error: cannot listen on {host}:{port}: {exc.strerror or exc} "
                   "(choose another --port or --host)", err=True)
        sys.exit(2)
    serve(artifact, config, listener, grace_period_s=grace_period,
          num_threads=threads, kernels=kernels, max_num_seqs=max_num_seqs,
          max_num_batched_tokens=max_num_batched_tokens, num_blocks=num_blocks,
          max_context=max_context, enable_prefix_caching=not no_prefix_caching,
          **_streaming_kwargs(sinks, window, h2o),
          **_speculation_kwargs(speculative, gamma, spec_max_batch, drafts, draft_tree))


PROMPT_DESCRIPTIONS = {
    "text": "text (built-in English passages, asked about in chat form when the artifact "
            "has a chat template; --prompts random for random token ids)",
    "random": "random token ids (they flatter speculation; --prompts text for real text)",
}


def _speculation_line(result: Any) -> str:
    if result.acceptance_rate is None:
        return ""
    return (f", acceptance {result.acceptance_rate:.2f}, {result.tokens_per_step:.2f} "
            "tokens/step")
