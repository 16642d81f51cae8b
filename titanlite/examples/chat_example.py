"""A small chat data set and a Hugging Face tokenizer folder for it, made here from the sample corpus (no downloads).

    python -m titanlite.examples.chat_example --output DIR [--conversations N]

writes DIR/tokenizer/ (tokenizer.json: a byte-level BPE trained on the sample corpus with the ChatML
special tokens <|endoftext|>, <|im_start|>, <|im_end|>; tokenizer_config.json with eos <|im_end|> and
a ChatML chat template) and DIR/chats.jsonl (conversations about the Python help topics: a question
on a topic answered with its opening paragraph, some with a system turn, some with a second turn).
Train on them with

    python -m titanlite.train --job.config_file train_configs/debug_model.toml --model.hf_assets_path DIR/tokenizer \\
        --training.dataset_path DIR/chats.jsonl --training.dataset_format chat
"""

import argparse
import json
from pathlib import Path
from pydoc_data.topics import topics

CHATML_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tokenizer_folder(
    folder: Path,
    bos_token: str | None = None,
    chat_template: str = CHATML_TEMPLATE,
    post_bos: bool = False,
    vocab_size: int = 600,
) -> Path:
    """A byte-level BPE tokenizer.json trained on the sample corpus, with tokenizer_config.json beside it;
    post_bos: the post-processor adds bos, as Llama 3's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from titanlite.data.sample_corpus import sample_documents

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHATML_TOKENS + ([bos_token] if bos_token else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sample_documents()[:200], trainer)
    if post_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A",
            pair=f"{bos_token} $A $B",
            special_tokens=[(bos_token, tokenizer.token_to_id(bos_token))],
        )
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": chat_template,
        "model_max_length": 4096,
    }
    if bos_token:  # written as transformers writes an AddedToken
        config["bos_token"] = {
            "__type": "AddedToken",
            "content": bos_token,
            "special": True,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def paragraphs(text: str) -> list[str]:
    return [" ".join(part.split()) for part in text.split("\n\n") if part.strip() and not part.startswith(" ")]


def chat_records(count: int) -> list[dict]:
    """`count` conversations about the help topics, in a fixed order (cycling through the topics)."""
    names = sorted(name for name in topics if len(paragraphs(topics[name])) >= 3)
    records = []
    for i in range(count):
        name = names[i % len(names)]
        first, second = paragraphs(topics[name])[1:3]
        messages = [
            {"role": "user", "content": f"What does Python's help say about {name}?"},
            {"role": "assistant", "content": first[:300]},
        ]
        if i % 3 == 1:
            messages.insert(
                0, {"role": "system", "content": "You answer questions about Python from its documentation."}
            )
        if i % 2 == 1:
            messages += [{"role": "user", "content": "Tell me more."}, {"role": "assistant", "content": second[:300]}]
        records.append({"messages": messages})
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--conversations", type=int, default=400)
    args = parser.parse_args(argv)
    write_tokenizer_folder(args.output / "tokenizer")
    records = chat_records(args.conversations)
    (args.output / "chats.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    print(f"wrote {args.output / 'tokenizer'} and {len(records)} conversations to {args.output / 'chats.jsonl'}")


if __name__ == "__main__":
    main()
