"""vLLM's P/D handshake against two workers, as a disaggregating proxy does it.

    mooncake-operator worker --role prefill --port 8100 --kv-events-port 5557 --time-scale 0 &
    mooncake-operator worker --role decode  --port 8200 --kv-events-port 5558 --time-scale 0 &
    python examples/worker/pd_handshake.py --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200

Add ``--store 127.0.0.1:50051 --store-metadata http://127.0.0.1:8080/metadata`` to both
workers (with a running ``mooncake_master``) to hand the KV over through Mooncake Store.
"""

from __future__ import annotations

import argparse

import openai


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", default="http://127.0.0.1:8100")
    ap.add_argument("--decode", default="http://127.0.0.1:8200")
    ap.add_argument("--model", default="llama3-70b-sim")
    ap.add_argument("--prompt", default="Explain KV cache disaggregation in one paragraph. " * 8)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    prefill = openai.OpenAI(base_url=args.prefill + "/v1", api_key="none")
    decode = openai.OpenAI(base_url=args.decode + "/v1", api_key="none")

    # 1. prefill with max_tokens=1 and do_remote_decode
    p = prefill.completions.create(
        model=args.model, prompt=args.prompt, max_tokens=1,
        extra_body={"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}},
    )
    kvp = (p.model_extra or {})["kv_transfer_params"]
    print("prefill said:", repr(p.choices[0].text))
    print("kv_transfer_params:", {k: v for k, v in kvp.items() if k != "remote_block_keys"})
    # 2. decode with the returned params, streaming the answer back
    stream = decode.completions.create(
        model=args.model, prompt=args.prompt, max_tokens=args.max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"kv_transfer_params": kvp},
    )
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].text, end="", flush=True)
        if chunk.usage:
            print(f"\nusage: {chunk.usage}")


if __name__ == "__main__":
    main()
