"""Writes tiny-chat/: a small byte-level BPE tokenizer in Hugging Face's format, for tests.

Nothing may be downloaded at run time, so the tests carry their own tokenizer: trained here
with the `tokenizers` library on a few English sentences (a vocabulary of 2,000 at most,
Llama-3-style special tokens), with a `tokenizer_config.json` whose `chat_template` renders
messages the way Llama 3's does (header, blank line, content, end of turn), and what the
families SGLang serves render beside them: tools as indented JSON after a preamble (Llama
3.1), an assistant's tool calls, and the switches `reasoning_effort`, `enable_thinking`,
`thinking`. A chat of plain messages renders as Llama 3's. A gateway and an engine that load
these two files produce the same token ids for the same chat. Run it again only to change the
tokenizer: `python tests/data/tokenizers/make_tiny_chat.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    # Tools, as Llama 3.1-style templates give them: a preamble, then each schema as
    # indented JSON (what a request's tools cost in prompt tokens).
    "{% if tools %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    '{{ \'You may call these functions. Answer a call as {"name": its name, '
    '"parameters": an object of its arguments}.\\n\\n\' }}'
    "{% for tool in tools %}{{ tool | tojson(indent=4) }}{{ '\\n\\n' }}{% endfor %}"
    "{{ '<|eot_id|>' }}{% endif %}"
    "{% if reasoning_effort is defined and reasoning_effort %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nReasoning: ' + reasoning_effort"
    " + '<|eot_id|>' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] }}"
    "{% if message['tool_calls'] is defined %}{% for call in message['tool_calls'] %}"
    "{{ '{\"name\": \"' + call['function']['name'] + '\", \"parameters\": '"
    " + (call['function']['arguments'] | tojson) + '}' }}{% endfor %}{% endif %}"
    "{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% if thinking is defined and thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)
CORPUS = """
You are a helpful assistant for an online store. Answer questions about orders, returns,
shipping and payments. Be brief and polite, and never invent an order number.
The quick brown fox jumps over the lazy dog. A platform team runs large language models on
graphics processors; every request reads a prompt, fills a cache of keys and values, and
writes tokens one at a time until it stops. Routing a request to the replica that already
holds its prefix saves the time to first token and the cost of the prefill.
the of and to in is it you that he was for on are as with his they at be this have from or
one had by word but not what all were we when your can said there use an each she do how
their if will up out many then them so some her would make like him into time has look two
more go see no way could my than been call who its now find long down day did get come made
may part over new take only home us know year live give most very good name just form much
such turn mean move same tell does set want air well also play small end put read hand large
add even land here must big high act why ask men went need try kind off line farm page grow
four mile fast self cold system user assistant question answer document search support chat
""".strip()


def main() -> None:
    out = Path(__file__).parent / "tiny-chat"
    out.mkdir(exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS.splitlines() * 4
    tok.train_from_iterator(lines, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
