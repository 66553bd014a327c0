"""State-dict hooks that keep the unfused model's keys (and their order) on a fused model
and load either naming."""

from __future__ import annotations

import re


# ---- keeping the unfused model's state dict keys --------------------------------------------
def _renamed(key: str, renames: list[tuple[str, str]]) -> str:
    for old, new in renames:
        if key.startswith(old):
            return new + key[len(old) :]
    return key


class _SaveUnderOriginalNames:
    """state_dict post-hook: the fused chains' entries under the unfused model's keys, in the
    unfused model's order.

    ``renames``: (fused prefix, original prefix) pairs relative to the hooked module, e.g.
    ``("conv1.bn.", "bn1.")``; ``order``: the unfused module's keys, relative to it (a block
    holds its BatchNorm and neuron next to its synapse, where the unfused module may have
    registered, say, every conv before every BatchNorm)."""

    # Hooks pickled by versions before the order was kept have none: their order stays.
    rank: dict[str, int] = {}

    def __init__(self, renames: tuple[tuple[str, str], ...], order: tuple[str, ...]) -> None:
        self.renames = renames
        self.rank = {key: i for i, key in enumerate(order)}

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        renames = [(prefix + fused, prefix + original) for fused, original in self.renames]
        # Re-insert this module's entries (the dict's tail) renamed, those the unfused module
        # had in its order; the others (another chain's, not renamed yet; modules replaced
        # since fusing) keep their places.
        entries = [(k, state_dict.pop(k)) for k in [k for k in state_dict if k.startswith(prefix)]]
        renamed = [(_renamed(key, renames), value) for key, value in entries]
        known = [i for i, (key, _) in enumerate(renamed) if key[len(prefix) :] in self.rank]
        in_order = sorted((renamed[i] for i in known), key=lambda e: self.rank[e[0][len(prefix) :]])
        for i, entry in zip(known, in_order, strict=True):
            renamed[i] = entry
        for key, value in renamed:
            state_dict[key] = value
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:  # BatchNorm's version entry moves with its keys
            for key in [k for k in metadata if k.startswith(prefix)]:
                new = _renamed(key + ".", renames)[:-1]
                if new != key:
                    metadata[new] = metadata.pop(key)


_SIZE_MISMATCH = re.compile(r"^(size mismatch for )([^:]+)")  # torch's load_state_dict message


class _LoadOriginalNames:
    """load_state_dict pre-hook: entries under the unfused model's keys load into the fused
    chains; entries already under the fused keys load as they are. Its :meth:`name_keys` (the
    post-hook) reports missing and unexpected entries and size mismatches under the unfused
    keys too, the names the model's ``state_dict`` has."""

    # the load running now: the hooked module's prefix in it (post-hooks are given none) and
    # its error messages (a list torch raises from after the post-hooks; dropped by them)
    prefix = ""
    error_msgs: list[str] | None = None

    def __init__(self, renames: tuple[tuple[str, str], ...]) -> None:
        self.renames = renames

    def name_keys(self, module, incompatible_keys) -> None:
        renames = [(self.prefix + f, self.prefix + original) for f, original in self.renames]
        for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
            keys[:] = [_renamed(key, renames) for key in keys]
        messages, self.error_msgs = self.error_msgs, None
        if messages:  # "size mismatch for <key>: ..." (torch's wording)
            messages[:] = [
                _SIZE_MISMATCH.sub(lambda m: m[1] + _renamed(m[2], renames), message)
                for message in messages
            ]

    # the post-hook's name in versions that renamed missing keys only (pickled models)
    name_missing_keys = name_keys

    def __call__(
        self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs
    ) -> None:
        self.prefix, self.error_msgs = prefix, error_msgs
        fused = [prefix + f for f, _ in self.renames]
        # Longest original prefix first: '0.0.' (in a container) before '0.'.
        renames = sorted(
            ((prefix + original, prefix + f) for f, original in self.renames),
            key=lambda pair: -len(pair[0]),
        )
        for key in list(state_dict):
            if key.startswith(prefix) and not any(key.startswith(f) for f in fused):
                new = _renamed(key, renames)
                if new == key:
                    continue
                value = state_dict.pop(key)
                if new in state_dict:  # both namings: which one to load is not ours to pick
                    error_msgs.append(
                        f"both {key!r} (the unfused name) and {new!r} (the fused name) name "
                        "one tensor: keep one of them"
                    )
                    continue
                state_dict[new] = value
