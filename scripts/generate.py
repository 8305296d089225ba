"""gpt2-generate: continue a prompt with GPT-2 from the command line, streaming the text as it comes.

    gpt2-generate "The meaning of life is" --model gpt2 --max-new-tokens 50 --temperature 0.8 --top-k 40
    gpt2-generate "Hello" --model ./my-checkpoint --greedy --dump-activations out.safetensors \
        --hooks 'blocks.*.hook_resid_post'
    gpt2-generate "I think that" --model gpt2 --greedy --sae res8=./res-jb/blocks.8.hook_resid_pre \
        --steer '{"hook": "blocks.8.hook_resid_pre",
                 "op": "steer", "scale": 8, "direction": {"sae": "res8", "feature": 1}}'
"""

from __future__ import annotations

if __name__ == "__main__":  # `python scripts/generate.py`: started as `gpt2-generate` is, which holds a Ctrl-C
    from gpt2_scripts.console import generate  # during the imports below (this file is imported again there)

    generate()

import argparse
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpt2_scripts.console import empty_flag, takes_negative_values
from gpt2_scripts.sae_cli import add_sae_arguments, directions, steering_edits, steering_specs

from model.dump import dump_path_problem, save_dump
from model.generate import Generation, GenerationError, SamplingParams, logit_bias_by_id
from model.hooks import UnknownHookError, check_hook_name, is_glob
from model.interventions import InterventionError
from model.lab.sae import SAEError
from model.loading import DTYPE_NAMES, LoadError, add_checkpoint_arguments, hub_repo, load_from
from model.tokenizer import InvalidTextError, Tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpt2-generate", description="Continue a prompt with GPT-2.")
    takes_negative_values(p)
    p.add_argument("prompt", nargs="?", help="the prompt (read from standard input when omitted or '-')")
    add_checkpoint_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=50, help="tokens to generate at most (default 50)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default 1; 0 is --greedy)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens (default 0: all)")
    p.add_argument("--top-p", type=float, help="sample from the nucleus of this probability mass (default 1)")
    p.add_argument(
        "--min-p", type=float, help="sample among tokens at least this fraction as likely as the likeliest (default 0)"
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        help="divide a positive logit (multiply a negative one) of each token already in the prompt or the "
        "text by this (default 1: off; 1.2 is common)",
    )
    p.add_argument(
        "--presence-penalty", type=float, help="subtract this from the logit of each token generated before (-2..2)"
    )
    p.add_argument(
        "--frequency-penalty", type=float, help="subtract this per time a token was generated before (-2..2)"
    )
    p.add_argument(
        "--logit-bias",
        action="append",
        type=_bias_flag,
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit before choosing (repeatable; 50256=-100 all but bans "
        "<|endoftext|>)",
    )
    p.add_argument("--seed", type=int, help="makes sampling reproducible (greedy needs none)")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (temperature 0)")
    p.add_argument("--stop", action="append", default=[], help="stop before this string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going after <|endoftext|>")
    p.add_argument(
        "--show-logprobs",
        type=int,
        nargs="?",
        const=5,
        metavar="N",
        help="print each token's log-probability and the N most likely alternatives (default 5) after the text",
    )
    p.add_argument("--dump-activations", metavar="FILE", help="write activations to this .safetensors file")
    p.add_argument(
        "--hooks",
        action="append",
        metavar="PATTERN",
        help="hook names or globs to dump (repeatable; default: *, every default hook point, not the optional ones)",
    )
    p.add_argument(
        "--dump-dtype",
        choices=("float32", "float16", "bfloat16"),
        help="the dump's dtype, whatever the model's (default float32, as the server's dumps; float16 or bfloat16: "
        "half the size)",
    )
    add_sae_arguments(p, steer=True)
    args = p.parse_args(argv)
    if args.greedy and args.temperature is not None:
        p.error("--greedy and --temperature conflict (--greedy is --temperature 0)")
    if args.greedy or args.temperature == 0:  # the most likely token is taken: nothing is sampled to narrow
        narrowing = (
            ("--top-k", args.top_k not in (None, 0, -1, 1)),  # 0 and -1: no limit; 1: greedy's own
            ("--top-p", args.top_p not in (None, 1.0)),
            ("--min-p", args.min_p not in (None, 0.0)),
        )
        given = [flag for flag, narrows in narrowing if narrows]
        if given:
            how = "--greedy" if args.greedy else "--temperature 0"
            verb = "narrow" if len(given) > 1 else "narrows"
            p.error(f"{' and '.join(given)} {verb} sampling, and {how} samples nothing: drop one")
    return args


def _bias_flag(text: str) -> tuple[str, float]:
    """`--logit-bias ID=BIAS` as (the id as written, the bias): `logit_bias_by_id` reads the ids as the API's
    keys, `SamplingParams` checks the values."""
    token, sep, bias = text.partition("=")
    try:
        if sep and token:
            return token, float(bias)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected ID=BIAS, a token id and a number (50256=-100), got {text!r}")


ADJUSTMENTS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")  # flags as SamplingParams'


class PromptError(Exception):
    """The prompt cannot be read: it was to come from standard input, which is closed (`<&-`), or it holds
    bytes that are not UTF-8."""


def read_prompt(arg: str | None) -> str:
    """The prompt argument, or standard input when it is omitted or '-'; bytes that are not UTF-8 (which
    reach Python as lone surrogates, U+DC80-U+DCFF, in an argument as from standard input) are an error
    that names the first of them as the byte it is (`utf8_checked`)."""
    if arg not in (None, "-"):
        text = arg
    elif sys.stdin is None:
        raise PromptError("no prompt: standard input is closed; give the prompt as an argument")
    else:
        raw = getattr(sys.stdin, "buffer", None)
        text = sys.stdin.read() if raw is None else raw.read().decode("utf-8", "surrogateescape")
    return utf8_checked(text)


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")  # GPT-2's, whichever a loader reads


def replaces_an_input(flag: str, dump: str, model: str, tokenizer: str | None, saes: list[str]) -> str | None:
    """Why a dump (or `gpt2-analyze`'s figure, written as one) must not go to `dump`, given as `flag`: a file
    there already that this run reads, which the dump would replace
    (read, then written over): of the local checkpoint `model` (any file of its directory; or the weights file
    itself, with the config.json and tokenizer files beside it that a bare file's loading reads too), of the
    hub's cache where `model` or an SAE is a hub name, of the `--tokenizer` directory (its tokenizer files,
    each of them, not only the one loading prefers: another loader reads the others), or of an `--sae`
    directory (`ID=PATH`)."""
    target = Path(dump).absolute()
    if not target.exists():
        return None
    checkpoint = Path(model).expanduser().absolute()
    if checkpoint.is_file():
        near = checkpoint.parent
        read = [checkpoint, near / "config.json", *(near / f for f in TOKENIZER_FILES)]
    elif checkpoint.is_dir():
        read = [checkpoint]
    elif hub_repo(model) is not None:
        read = [_hub_cache()]
    else:
        read = []
    if _one_of(target, read):
        return f"{flag} {dump}: it would replace a file of the checkpoint being loaded ({model})"
    tok = Path(tokenizer).expanduser().absolute() if tokenizer else None
    if tok is not None and tok.is_dir() and _one_of(target, [tok / f for f in TOKENIZER_FILES]):
        return f"{flag} {dump}: it would replace a file of the tokenizer being loaded ({tokenizer})"
    for spec in saes:
        source = spec.partition("=")[2]
        path = Path(source).expanduser().absolute()
        if _one_of(target, [path] if path.exists() else [_hub_cache()] if source else []):
            return f"{flag} {dump}: it would replace a file of the SAE being loaded ({spec})"
    return None


@contextmanager
def saying_when_written(path: str, wrote: str) -> Iterator[None]:
    """Say `wrote` once the block has put a new file at `path` (renamed over it), also where a Ctrl-C or a
    SIGTERM ends the block after the rename: the tool then says both, not "interrupted" alone over a new file."""
    before = _file_id(path)
    try:
        yield
    except KeyboardInterrupt:
        if _file_id(path) != before:
            print(wrote, file=sys.stderr)
        raise
    print(wrote, file=sys.stderr)


def _file_id(path: str) -> tuple[int, int] | None:
    """The file at `path` (through links), as a rename over it changes it; None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser().absolute()


def _one_of(target: Path, paths: list[Path]) -> bool:
    """Whether `target` is one of `paths` (that exist) or lies in one that is a directory, as given, through
    symlinks (a hub cache's snapshot holds links to its blobs) or as a hard link to one of them or to a file
    directly in one that is a directory (a checkpoint's, an SAE's)."""
    for path in (p for p in paths if p.exists()):
        for t, q in ((target, path), (target.resolve(), path.resolve())):
            if t == q or (q.is_dir() and q in t.parents):
                return True
        if target.is_file():
            files = [path] if path.is_file() else [f for f in path.iterdir() if f.is_file()]
            if any(os.path.samefile(target, f) for f in files):
                return True
    return False


def utf8_checked(text: str, what: str = "the prompt") -> str:
    """`text`, unless it holds bytes that are not UTF-8 (surrogateescape's U+DC80-U+DCFF, as Python reads an
    argument or standard input): then a `PromptError` naming the first as the byte it is."""
    if bad := _NOT_UTF8.search(text):
        byte = ord(bad.group()) - 0xDC00
        raise PromptError(f"{what} is not valid UTF-8: it holds the byte 0x{byte:02X} at character {bad.start()}")
    return text


_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, as surrogateescape reads it


def main(argv: list[str] | None = None) -> int:  # Ctrl-C leaves nothing half-written: a dump is written at the end
    args = parse_args(argv)
    if problem := empty_flag((("--model", args.model), ("--dump-activations", args.dump_activations))):
        return fail(problem)
    if args.hooks and not args.dump_activations:
        return fail("--hooks needs --dump-activations FILE")
    if args.dump_dtype and not args.dump_activations:
        return fail("--dump-dtype needs --dump-activations FILE")
    if args.dump_activations == "-":
        return fail("--dump-activations -: a dump is a file (the text goes to standard output); name one")
    if args.dump_activations and (problem := dump_path_problem(args.dump_activations)):  # before the long part
        return fail(problem)
    dump = args.dump_activations
    if dump and (problem := replaces_an_input("--dump-activations", dump, args.model, args.tokenizer, args.sae)):
        return fail(problem)
    try:  # an exact name no GPT-2 has, before the model loads (a glob, or a layer past it, is checked after)
        for name in args.hooks or []:
            if not is_glob(name):
                check_hook_name(name)
    except UnknownHookError as e:
        return fail(f"--hooks: {e}")
    if sys.stdout is None:
        return fail("standard output is closed: nowhere to write the text")
    try:
        for i, stop in enumerate(args.stop):  # bytes that are not UTF-8 could never match the text
            utf8_checked(stop, f"--stop number {i + 1}" if len(args.stop) > 1 else "--stop")
        prompt = read_prompt(args.prompt)  # last: it may wait for standard input
    except PromptError as e:
        return fail(str(e))
    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=0.0 if args.greedy else 1.0 if args.temperature is None else args.temperature,
            top_k=0 if args.top_k is None else args.top_k,
            top_p=1.0 if args.top_p is None else args.top_p,
            logit_bias=logit_bias_by_id(args.logit_bias),
            **{name: value for name in ADJUSTMENTS if (value := getattr(args, name)) is not None},
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
            logprobs=args.show_logprobs,
        )
        steer = steering_specs(args.steer)  # a typo found before the model loads
        loaded = load_from(args)
        tok = loaded.tokenizer
        hooks = (args.hooks or ["*"]) if args.dump_activations else None
        edits = steering_edits(steer, directions(args, loaded), loaded.model.config.n_layer)
        dump_dtype = DTYPE_NAMES[args.dump_dtype or "float32"] if hooks else None  # cast as each is captured
        generation = Generation(loaded.model, [tok.encode(prompt)], params, tok, hooks, edits, dump_dtype)
    except GenerationError as e:
        return fail(in_flags(e))
    except UnknownHookError as e:
        return fail(f"--hooks: {e}")
    except (LoadError, InvalidTextError, InterventionError, SAEError) as e:
        return fail(str(e))

    try:
        failure = _write_text(prompt, generation, tok)
    except BrokenPipeError:  # the reader went away (`| head`): `run_console` ends the process as `cat` ends
        raise
    except OSError as e:  # a full disk (`> /dev/full`), say
        return fail(f"cannot write the text: {e.strerror or e}")
    if failure is not None:
        return fail(failure)
    result = generation.results[0]
    if args.dump_activations and result.activations is not None:
        token_ids = result.prompt_ids + result.token_ids
        meta = {"model": loaded.name, "weights": loaded.weights, "token_ids": token_ids, "text": prompt + result.text}
        wrote = f"wrote {len(result.activations)} activations over {len(token_ids)} tokens to {args.dump_activations}"
        try:
            with saying_when_written(args.dump_activations, wrote):
                save_dump(args.dump_activations, result.activations, meta)
        except OSError as e:
            return fail(f"cannot write {args.dump_activations}: {e.strerror or e}")
        except ValueError as e:  # the path went bad during the generation (`dump_path_problem` again)
            return fail(str(e))
    print(f"[{len(result.token_ids)} tokens, finish reason: {result.finish_reason}]", file=sys.stderr)
    return 0


FLAGS = {  # SamplingParams' fields, as this command's flags name them
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "logit_bias": "--logit-bias",
    "seed": "--seed",
    "stop": "--stop",
    "logprobs": "--show-logprobs",
}


def in_flags(e: GenerationError) -> str:
    """The error's message with the field it names written as the flag that set it."""
    message = str(e)
    for field, flag in FLAGS.items():
        message = re.sub(rf"\b{field}\b", flag, message)
    return re.sub(r"--stop\[(\d+)\]", lambda m: f"--stop number {int(m[1]) + 1}", message)  # as the flag counts


def _write_text(prompt: str, generation: Generation, tok: Tokenizer) -> str | None:
    """The prompt, then each piece of text as it is generated, then, if asked for, each token's logprobs, to
    standard output; the error that ended the generation, if one did."""
    out = sys.stdout
    out.write(prompt)
    out.flush()
    try:
        for event in generation:
            out.write(event.text)
            out.flush()
    except (GenerationError, InterventionError) as e:  # the logits became inf or NaN (float16 overflowing, say)
        out.write("\n")
        out.flush()
        return str(e)
    out.write("\n")
    result = generation.results[0]
    if result.logprobs is not None:
        columns = ["token", "logprob"] + (["alternatives"] if any(lp.top for lp in result.logprobs) else [])
        out.write("\n" + "\t".join(columns) + "\n")  # `--show-logprobs 0`: no alternatives, no column for them
        for lp in result.logprobs:
            alts = ["  ".join(f"{tok.token_text(i)!r}:{v:.3f}" for i, v in lp.top)] if lp.top else []
            out.write("\t".join([repr(tok.token_text(lp.id)), f"{lp.logprob:.4f}", *alts]) + "\n")
    out.flush()
    return None


def fail(message: str) -> int:
    print(f"gpt2-generate: error: {message}", file=sys.stderr)
    return 1
