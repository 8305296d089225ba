"""gpt2-generate: continue a prompt with GPT-2 from the command line, streaming the text as it comes.

    gpt2-generate "The meaning of life is" --model gpt2 --max-new-tokens 50 --temperature 0.8 --top-k 40
    gpt2-generate "Hello" --model ./my-checkpoint --greedy --dump-activations out.safetensors \
        --hooks 'blocks.*.hook_resid_post'
    gpt2-generate "I think that" --model gpt2 --greedy --sae res8=./res-jb/blocks.8.hook_resid_pre \
        --steer '{"hook": "blocks.8.hook_resid_pre",
                 "op": "steer", "scale": 8, "direction": {"sae": "res8", "feature": 1}}'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpt2_scripts.sae_cli import add_sae_arguments, directions, steering_edits
from safetensors import SafetensorError

from model.dump import save_dump
from model.generate import Generation, GenerationError, SamplingParams
from model.hooks import UnknownHookError
from model.interventions import InterventionError
from model.lab.sae import SAEError
from model.loading import LoadError, add_checkpoint_arguments, load_from
from model.tokenizer import InvalidTextError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpt2-generate", description="Continue a prompt with GPT-2.")
    p.add_argument("prompt", nargs="?", help="the prompt (read from standard input when omitted or '-')")
    add_checkpoint_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the nucleus of this probability mass")
    p.add_argument("--seed", type=int, help="makes sampling reproducible")
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
        help="hook names or globs to dump (repeatable; default: every hook point)",
    )
    add_sae_arguments(p, steer=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hooks and not args.dump_activations:
        return fail("--hooks needs --dump-activations FILE")
    if args.dump_activations and not Path(args.dump_activations).parent.is_dir():  # before the long part
        return fail(f"cannot write {args.dump_activations}: no directory {Path(args.dump_activations).parent}")
    prompt = sys.stdin.read() if args.prompt in (None, "-") else args.prompt
    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=0.0 if args.greedy else args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
            logprobs=args.show_logprobs,
        )
        loaded = load_from(args)
        tok = loaded.tokenizer
        hooks = (args.hooks or ["*"]) if args.dump_activations else None
        edits = steering_edits(args.steer, directions(args, loaded), loaded.model.config.n_layer)
        generation = Generation(loaded.model, [tok.encode(prompt)], params, tok, hooks, edits)
    except (LoadError, GenerationError, UnknownHookError, InvalidTextError, InterventionError, SAEError) as e:
        return fail(str(e))

    out = sys.stdout
    out.write(prompt)
    out.flush()
    for event in generation:
        out.write(event.text)
        out.flush()
    out.write("\n")
    result = generation.results[0]

    if result.logprobs is not None:
        out.write("\ntoken\tlogprob\talternatives\n")
        for lp in result.logprobs:
            alts = "  ".join(f"{tok.token_text(i)!r}:{v:.3f}" for i, v in lp.top)
            out.write(f"{tok.token_text(lp.id)!r}\t{lp.logprob:.4f}\t{alts}\n")
    if args.dump_activations and result.activations is not None:
        token_ids = result.prompt_ids + result.token_ids
        meta = {"model": loaded.name, "token_ids": token_ids, "text": prompt + result.text}
        try:
            save_dump(args.dump_activations, result.activations, meta)
        except OSError as e:
            return fail(f"cannot write {args.dump_activations}: {e.strerror or e}")
        except SafetensorError as e:  # safetensors reports its I/O failures as its own error
            return fail(f"cannot write {args.dump_activations}: {e}")
        print(
            f"wrote {len(result.activations)} activations over {len(token_ids)} tokens to {args.dump_activations}",
            file=sys.stderr,
        )
    print(f"[{len(result.token_ids)} tokens, finish reason: {result.finish_reason}]", file=sys.stderr)
    return 0


def fail(message: str) -> int:
    print(f"gpt2-generate: error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
