"""Speech side: corpus, units, vocoder, tokenizer, the shipped TextToSemantic and the pipeline."""
