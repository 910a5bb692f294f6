"""The commands around training, above everything they use: the memory plan (`plan`,
`plan_report`), the rates measured on this machine (`measure`), plots and summaries of a run
(`report`), and the processes of a run over several hosts (`distributed`)."""
