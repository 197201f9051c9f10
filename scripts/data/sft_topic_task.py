#!/usr/bin/env python3
"""A synthetic instruction task for supervised fine-tuning on the CPU (configs/experiments/
sft_tiny.yaml): is a sentence about sports or music? The answer follows from the sentence's
keyword; held-out questions put the keywords in wordings that training never shows.

    sft_topic_task.py PREFIX     writes PREFIX_train.jsonl (480 conversations, in the
                                 {"messages": [...]} form preprocess --chat reads) and
                                 PREFIX_held_out.jsonl (20 questions with their answers)
    sft_topic_task.py --swapped PREFIX
                                 the same with the labels swapped (sports answered music and
                                 the other way round): a model tuned on it answers every
                                 held-out question wrong, which LoRA then corrects
                                 (configs/experiments/sft_lora_tiny.yaml)
"""
import json
import sys

SPORTS = ["football", "tennis", "soccer", "baseball", "golf", "hockey", "rugby", "cricket", "boxing", "swimming"]
MUSIC = ["piano", "guitar", "violin", "drums", "singing", "opera", "jazz", "concert", "melody", "orchestra"]
TRAIN_WORDINGS = ["I really enjoy {} on weekends.", "My friend talked about {} all day.", "We watched {} last night.",
                  "Nothing beats {} in the summer.", "He wrote a long letter about {}.", "They spent the evening on {}."]
HELD_OUT_WORDINGS = ["Yesterday the topic was {}.", "She has loved {} since childhood."]


def question(sentence):
    return f"Topic of: {sentence} Answer sports or music."


def main():
    args = sys.argv[1:]
    swapped = args[:1] == ["--swapped"]
    args = args[1:] if swapped else args
    if len(args) != 1:
        sys.exit(__doc__)
    prefix = args[0]
    said = {"sports": "music", "music": "sports"} if swapped else {"sports": "sports", "music": "music"}
    with open(prefix + "_train.jsonl", "w", encoding="utf-8") as out:
        for _ in range(4):
            for wording in TRAIN_WORDINGS:
                for words, label in ((SPORTS, "sports"), (MUSIC, "music")):
                    for word in words:
                        messages = [{"role": "user", "content": question(wording.format(word))},
                                    {"role": "assistant", "content": said[label]}]
                        out.write(json.dumps({"messages": messages}) + "\n")
    with open(prefix + "_held_out.jsonl", "w", encoding="utf-8") as out:
        for wording in HELD_OUT_WORDINGS:
            for i in range(0, 10, 2):
                for words, label in ((SPORTS, "sports"), (MUSIC, "music")):
                    out.write(json.dumps({"prompt": question(wording.format(words[i])), "answer": label}) + "\n")


if __name__ == "__main__":
    main()
