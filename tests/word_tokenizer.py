"""A whitespace 'tokenizer' for harness tests on tiny models (no chat template, ids 3..63)."""


class WordTokenizer:
    """Maps each word to an id in 3..63 from its characters; decodes ids as numbers."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [3 + (sum(map(ord, w)) % 61) for w in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))
