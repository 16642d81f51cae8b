"""Rewards for reinforcement learning (rl.reward_functions): the functions titanlite ships, with TRL's signature
(shipped.py), named in a config as `titanlite.rewards:math_answer`; and how any reward function is loaded and its
values combined into each completion's reward (loading.py)."""

from titanlite.rewards.shipped import boxed_format, completion_text, final_answer, format_reward, math_answer

__all__ = ["boxed_format", "completion_text", "final_answer", "format_reward", "math_answer"]
