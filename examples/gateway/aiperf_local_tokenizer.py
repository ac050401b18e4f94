"""Let aiperf replay a Mooncake trace against the gateway without downloading a tokenizer.

aiperf needs a Hugging Face tokenizer to turn a trace's ``hash_ids`` into prompts. Offline
it cannot download one, ``--tokenizer builtin`` downloads tiktoken's ``o200k_base``, and a
local directory is rejected in offline mode (it resolves names through the HF cache). This
script builds a word-level tokenizer locally and files it in a private HF cache layout
under the name ``local/wordtok``:

    python examples/gateway/aiperf_local_tokenizer.py /tmp/hf     # needs transformers
    HF_HOME=/tmp/hf HF_HUB_OFFLINE=1 aiperf profile --model llama3-70b-sim \\
        --tokenizer local/wordtok --url http://127.0.0.1:8080 --endpoint-type completions \\
        --streaming --input-file trace.jsonl --custom-dataset-type mooncake_trace \\
        --fixed-schedule --ui-type none
"""

from __future__ import annotations

import sys
from pathlib import Path

WORDS = 4000
REVISION = "0" * 40  # any 40-hex snapshot name


def main(hf_home: str) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[EOS]": 1} | {f"w{i}": i + 2 for i in range(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    repo = Path(hf_home) / "hub" / "models--local--wordtok"
    snap = repo / "snapshots" / REVISION
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                            eos_token="[EOS]").save_pretrained(str(snap))
    print(f"tokenizer 'local/wordtok' in HF_HOME={hf_home}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/hf"))
