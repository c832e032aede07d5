"""A multi-turn conversation load against an OpenAI-compatible server (`vllm serve`), modelled
on LMCache's multi-round QA benchmark: `users` conversations of `rounds` rounds; each user
starts from a long context of their own, and each round sends the whole history (context,
earlier questions and answers) plus a new question. Rounds go in turns over all users (every
user's round r before any user's round r+1), so between two rounds of one user the others'
requests pass through the engine: when the users' histories exceed the engine's KV cache,
each round's history must come back from somewhere, or be recomputed.

Requests go to `/v1/completions` as token ids (greedy, `ignore_eos`, streamed with
`return_token_ids`), so a user's history is exactly the token ids the engine saw and answered;
TTFT is the time to the first streamed token.

    python perf/serving/multiturn.py --url http://127.0.0.1:8000 --model bench --users 12 --rounds 4
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class Plan:
    """What the users say: each one's context and questions, as token ids."""

    users: int
    rounds: int
    context_len: int
    question_len: int
    answer_len: int
    seed: int
    vocab: int
    contexts: List[List[int]] = field(default_factory=list)
    questions: List[List[List[int]]] = field(default_factory=list)

    @classmethod
    def make(cls, users: int, rounds: int, context_len: int, question_len: int, answer_len: int,
             seed: int, vocab: int, first_word: int = 3) -> "Plan":
        rng = random.Random(seed)
        p = cls(users, rounds, context_len, question_len, answer_len, seed, vocab)

        def words(n: int) -> List[int]:
            return [rng.randrange(first_word, vocab) for _ in range(n)]

        p.contexts = [words(context_len) for _ in range(users)]
        p.questions = [[words(question_len) for _ in range(rounds)] for _ in range(users)]
        return p

    def longest_prompt(self) -> int:
        """Tokens of the last round's prompt, the longest request of the plan."""
        return self.context_len + self.rounds * self.question_len + (self.rounds - 1) * self.answer_len

    def working_set(self) -> int:
        """Tokens of every user's whole history at the end."""
        return self.users * (self.longest_prompt() + self.answer_len)

    def protocol(self) -> Dict[str, Any]:
        d = asdict(self)
        del d["contexts"], d["questions"]
        d["longest_prompt_tokens"] = self.longest_prompt()
        d["working_set_tokens"] = self.working_set()
        return d


@dataclass
class Outcome:
    user: int
    round: int
    prompt_tokens: int
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_ids: List[int] = field(default_factory=list)
    error: str = ""


def complete(url: str, model: str, prompt: List[int], max_tokens: int, timeout: float) -> Outcome:
    """One streamed greedy completion of token ids; its TTFT, duration and output ids."""
    parts = urllib.parse.urlsplit(url)
    out = Outcome(-1, -1, len(prompt))
    body = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "return_token_ids": True,
    })
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return out
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and not out.output_ids:
                    out.ttft_s = time.perf_counter() - t0
                out.output_ids.extend(ids)
        out.e2e_s = time.perf_counter() - t0
        if len(out.output_ids) != max_tokens:
            out.error = f"{len(out.output_ids)} tokens streamed, {max_tokens} asked"
    except (OSError, http.client.HTTPException, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return out


def run(url: str, model: str, plan: Plan, concurrency: int, timeout: float = 600.0) -> Dict[str, Any]:
    """Runs the plan; every request's outcome and the summary."""
    history = [list(c) for c in plan.contexts]
    done = [[threading.Event() for _ in range(plan.rounds)] for _ in range(plan.users)]
    outcomes: List[Outcome] = []
    lock = threading.Lock()

    def one(user: int, rnd: int) -> None:
        if rnd > 0:
            done[user][rnd - 1].wait()
        prompt = history[user] + plan.questions[user][rnd]
        o = complete(url, model, prompt, plan.answer_len, timeout)
        o.user, o.round = user, rnd
        # The answer joins the history even when it failed (as far as it came): the next
        # round asks anyway, as a user would.
        history[user] = prompt + o.output_ids
        with lock:
            outcomes.append(o)
        done[user][rnd].set()

    order = [(u, r) for r in range(plan.rounds) for u in range(plan.users)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for f in [pool.submit(one, u, r) for u, r in order]:
            f.result()
    wall = time.perf_counter() - t0
    outcomes.sort(key=lambda o: (o.round, o.user))
    return {"summary": summarize(outcomes, wall), "requests": [asdict(o) for o in outcomes]}


def quantile(xs: List[float], q: float) -> float:
    """The q-quantile of xs by linear interpolation (numpy's default)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(outcomes: List[Outcome], wall: float) -> Dict[str, Any]:
    ok = [o for o in outcomes if not o.error]
    ttft = [o.ttft_s * 1e3 for o in ok]
    e2e = [o.e2e_s * 1e3 for o in ok]
    out_tokens = sum(len(o.output_ids) for o in ok)
    rounds = sorted({o.round for o in ok})
    by_round = {str(r): statistics.fmean(o.ttft_s * 1e3 for o in ok if o.round == r) for r in rounds}
    return {
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "duration_s": wall,
        "mean_ttft_ms": statistics.fmean(ttft) if ttft else float("nan"),
        "median_ttft_ms": quantile(ttft, 0.5),
        "p99_ttft_ms": quantile(ttft, 0.99),
        "mean_e2el_ms": statistics.fmean(e2e) if e2e else float("nan"),
        "output_throughput": out_tokens / wall if wall > 0 else 0.0,
        "total_input_tokens": sum(o.prompt_tokens for o in ok),
        "total_output_tokens": out_tokens,
        # Round 0 asks each user's first context (nothing to reuse); later rounds reuse it.
        "mean_ttft_ms_by_round": by_round,
    }


def add_arguments(g: Any, prefix: str = "") -> None:
    """The load's options (`--{prefix}users`, ...), for this command and bench.py's."""
    for name, default, what in (("users", 12, "conversations"), ("rounds", 4, "rounds per conversation"),
                                ("context-len", 1024, "tokens of each user's first context"),
                                ("question-len", 64, "tokens of each question"),
                                ("answer-len", 16, "tokens of each answer"),
                                ("concurrency", 4, "requests in flight at most")):
        g.add_argument(f"--{prefix}{name}", type=int, default=default, help=f"{what} (default {default})")


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", required=True, help="the served model name")
    add_arguments(ap)
    ap.add_argument("--vocab", type=int, default=8192, help="token ids are drawn below this (default 8192)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the contexts and questions (default 0)")
    ap.add_argument("--out", help="write every request's outcome and the summary here (JSON)")
    a = ap.parse_args(argv)
    plan = Plan.make(a.users, a.rounds, a.context_len, a.question_len, a.answer_len, a.seed, a.vocab)
    res = run(a.url, a.model, plan, a.concurrency)
    res["protocol"] = plan.protocol()
    print(json.dumps(res["summary"], indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
