"""tools/greedy_tree_ab.py on one sentence: its trees (speculative beam search with one beam, spear-tts's
semantics) follow greedy decoding's path, and it reports every mode (its timings are not tested)."""

import json

from conftest import load_script

greedy_tree_ab = load_script("tools/greedy_tree_ab.py")


def test_trees_decode_greedy_tokens_with_a_weaker_head(tmp_path):
    out = tmp_path / "ab.json"
    greedy_tree_ab.main(["--widen", "0", "--sentences", "1", "--reps", "1", "--gammas", "2", "--widths", "2", "3",
                         "--noise", "2", "--threads", "1", "--json", str(out)])
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["plain", "chain auto", "chain 2", "tree 2x2", "tree 2x3"]
    assert all(row["same_tokens"] for row in rows.values())
    # the trees' drafts are accepted (a pass yields more than plain decoding's one token)
    assert min(rows[m]["tokens_per_target_pass"] for m in ("tree 2x2", "tree 2x3", "chain 2")) > 1.2
