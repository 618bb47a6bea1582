"""The ahead-of-time memory gate: the run's step (and its in-loop evaluation) compiled on
abstract shapes, XLA's figures read, the searches of `gate.fit`, the step's cost.
Imports the floors below it."""
