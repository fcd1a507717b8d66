"""Prompts and arrival patterns shared by the scheduler and engine tests."""

import torch


def random_prompts(lengths, vocab: int = 96, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths, the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def add_staggered(scheduler, prompts, new_tokens, params=None) -> list:
    """Add prompt i with ``new_tokens[i]`` (and ``params[i]``), stepping the scheduler 0 to 2 times
    after each (``i % 3``): requests arrive while others read prompts and decode. Returns them."""
    requests = []
    for arrival, (prompt, n) in enumerate(zip(prompts, new_tokens)):
        requests.append(scheduler.add(prompt, params[arrival] if params else None, max_new_tokens=n))
        for _ in range(arrival % 3):
            scheduler.step()
    return requests
