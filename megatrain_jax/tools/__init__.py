"""Tools around training: the memory plan (`plan`), the step's bound from measured rates
(`roofline`), plots and summaries of a run (`report`), and the progress line (`progress`)."""
