"""A composed config checked and resolved once into the `Run` everything below the front
end reads, and the run directory's files. Imports the floors below it."""
