"""What crosses the process boundary: checkpoints (`checkpoint`), Hugging Face folders
(`hf`), training data (`data`) and its preparation from text and chat files (`prepare`), with a
progress line for the long ones (`progress`)."""
