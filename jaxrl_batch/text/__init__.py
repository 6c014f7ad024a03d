"""Text: the tokenizer interface (`tokenizer`), SentencePiece and Hugging Face implementations,
`loading.load_tokenizer`, and chat templates (`chat_template`: the one route from messages to prompt text)."""
