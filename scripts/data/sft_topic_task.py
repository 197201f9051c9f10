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
    sft_topic_task.py --preference PREFIX
                                 preference pairs for DPO after that fine-tuning
                                 (configs/experiments/dpo_tiny.yaml), in TRL's form: chosen
                                 answers in a new style, "The topic is sports.", rejected either
                                 in the fine-tuned style ("sports") or in the new style with the
                                 wrong topic. PREFIX_pairs.jsonl: 480 pairs of the training
                                 wordings, then 20 of the held-out wordings (split 96,4,0 makes
                                 them the validation pairs); PREFIX_pairs_held_out.jsonl: the 20
                                 held-out questions with the answer DPO should make greedy
                                 generation give
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


def styled(label):
    return f"The topic is {label}."


def preference_pairs(prefix):
    other = {"sports": "music", "music": "sports"}

    def pair(sentence, label, k):
        rejected = label if k % 2 == 0 else styled(other[label])
        return json.dumps({"prompt": [{"role": "user", "content": question(sentence)}],
                           "chosen": [{"role": "assistant", "content": styled(label)}],
                           "rejected": [{"role": "assistant", "content": rejected}]}) + "\n"

    with open(prefix + "_pairs.jsonl", "w", encoding="utf-8") as out, \
            open(prefix + "_pairs_held_out.jsonl", "w", encoding="utf-8") as held:
        k = 0
        for _ in range(4):
            for wording in TRAIN_WORDINGS:
                for words, label in ((SPORTS, "sports"), (MUSIC, "music")):
                    for word in words:
                        out.write(pair(wording.format(word), label, k))
                        k += 1
        for wording in HELD_OUT_WORDINGS:
            for i in range(0, 10, 2):
                for words, label in ((SPORTS, "sports"), (MUSIC, "music")):
                    out.write(pair(wording.format(words[i]), label, k))
                    k += 1
                    held.write(json.dumps({"prompt": question(wording.format(words[i])), "answer": styled(label)}) + "\n")


def main():
    args = sys.argv[1:]
    if args[:1] == ["--preference"] and len(args) == 2:
        preference_pairs(args[1])
        return
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
