"""Two runs compared: their tokens aligned, each scored on the other's tokens (teacher-forced
requests sent by a worker), the logprob and activation differences drawn."""
