"""Question-answering data: datasets (JSON Lines, CSV, SQuAD, hub), prompt formats, metrics."""
